"""The forecast against a measurement on this machine: `python -m bench.forecast_check MODEL
--budgets 200MB 400MB [--tokens 32] [--runs 2] [--threads 1] [--json]`.

With the CPU as the tier, the forecast's cost model (offload/hybrid/decode_costs.py) prices
the plan `ember generate --gpu-budget B` makes: the whole-model plan (per layer "gpu", "split"
or "cpu", the LM head on the tier or not, every tensor in the file's bytes:
offload/hybrid/layer_plan.py:plan_forecast), read from the run's own report, with the "cpu"
card: the bandwidth the unsplit decode of the same file reached in a run just before (its file
bytes a token over its time), for the tier and the host alike, one memory bus (the two sides'
reads add up), kernels launched eagerly. Each run is a fresh `ember generate ... --json`
process; budgets are interleaved run by run, each beside its unsplit run, so that a busy
machine slows both alike. Both sides share two cores and one memory bus here, so this checks
the byte accounting and the host side's constants, not the overlap a GPU would give. One
thread by default: on a loaded 2-core machine the unsplit pass's two OpenMP threads wait at
every layer's barrier for a core, which makes the bandwidth it calibrates by meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "The history of the river begins in the mountains, where"


def measured_run(model: str, budget: str | None, tokens: int, threads: int) -> dict:
    """One `ember generate` with the budget (None: unsplit): its JSON (timings, the hybrid
    report)."""
    cmd = [sys.executable, "-m", "ember.app.cli", "generate", PROMPT, "--model", model,
           "--device", "cpu", "--threads", str(threads), "--max-tokens", str(tokens),
           "--temperature", "0", "--ignore-eos", "--json", "--profile", "none"]
    cmd += [] if budget is None else ["--gpu-budget", budget]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def decode_gbps(model: str, result: dict) -> float:
    """What the unsplit decode `result` reached: the file's bytes a token over its time
    (how `ember bench decode` reports its bandwidth)."""
    from ember.models.loader import open_model
    from ember.offload.body.file_layers import file_bytes_per_token

    source = open_model(model)
    return file_bytes_per_token(source.config, source.weights) * result["decode_tokens_per_s"] / 1e9


def forecast_ms(model: str, result: dict, gbps: float) -> dict:
    """The cost model's ms/token for the plan `result` ran, at the measured bandwidth."""
    from ember.models.loader import open_model
    from ember.offload.hybrid.decode_costs import DecodeSpeeds, ModelBytes, host_weight_bytes
    from ember.offload.hybrid.gpu_cards import cpu_card
    from ember.offload.hybrid.layer_plan import plan_forecast

    source = open_model(model)
    cfg, hybrid = source.config, result["hybrid"]
    # The mean position a decoded token sees: the prompt and half the generated tokens
    position = len(result["prompt_token_ids"]) + len(result["token_ids"]) // 2
    row = 2 * cfg.n_kv_heads * cfg.head_dim * 2  # one position's float16 K and V
    model_bytes = ModelBytes.of_file(cfg, source.weights, 2 * position,
                                     2 * position * row * cfg.n_layers)
    speeds = DecodeSpeeds(cpu_card(gbps * 1e9, 0), gbps, graphs=False)
    modes, head = hybrid["layer_modes"], hybrid["on_gpu_tier"]["lm_head"]
    hot = [round(f * cfg.ffn_size) for f in hybrid["hot_fraction_per_layer"]]
    host = host_weight_bytes(model_bytes, modes, hot, head)
    host_only = ["cpu"] * cfg.n_layers  # the same cost model on the unsplit run, for scale
    return {"ms_per_token": plan_forecast(model_bytes, speeds, modes, hot, head),
            "unsplit_ms_per_token": plan_forecast(model_bytes, speeds, host_only,
                                                  [0] * cfg.n_layers, False),
            "modes": {m: modes.count(m) for m in ("gpu", "split", "cpu")},
            "lm_head_on_tier": head, "host_weight_bytes_per_token": host,
            "tier_weight_bytes_per_token": model_bytes.weights_per_token() - host}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--budgets", nargs="+", required=True, metavar="SIZE")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="JSON only")
    args = p.parse_args(argv)
    from ember.app.commands.bench_decode import copy_bandwidth

    rows = {b: [] for b in args.budgets}
    for _ in range(args.runs):
        for budget in args.budgets:  # interleaved, each beside an unsplit run
            copy = copy_bandwidth() / 1e9
            unsplit = measured_run(args.model, None, args.tokens, args.threads)
            gbps = decode_gbps(args.model, unsplit)
            result = measured_run(args.model, budget, args.tokens, args.threads)
            measured = 1e3 / result["decode_tokens_per_s"]
            rows[budget].append((measured, forecast_ms(args.model, result, gbps),
                                 copy, result["hybrid"]["hot_fraction"], gbps,
                                 1e3 / unsplit["decode_tokens_per_s"]))
    report = []
    for budget, runs in rows.items():
        measured = [r[0] for r in runs]
        predicted = [r[1]["ms_per_token"] for r in runs]
        report.append({
            "model": Path(args.model).name, "gpu_budget": budget, "hot_fraction": runs[0][3],
            "measured_ms": {"median": statistics.median(measured), "min": min(measured),
                            "max": max(measured)},
            "forecast_ms": statistics.median(predicted),
            "copy_gbps": statistics.median(r[2] for r in runs),
            "unsplit_ms": statistics.median(r[5] for r in runs),
            "unsplit_forecast_ms": statistics.median(r[1]["unsplit_ms_per_token"] for r in runs),
            "unsplit_decode_gbps": statistics.median(r[4] for r in runs),
            **{k: runs[0][1][k] for k in ("modes", "lm_head_on_tier",
                                          "tier_weight_bytes_per_token",
                                          "host_weight_bytes_per_token")},
            "error": statistics.median(predicted) / statistics.median(measured) - 1})
    if not args.json:
        for r in report:
            print(f"{r['model']} at {r['gpu_budget']} ({r['modes']}, head on the tier: "
                  f"{r['lm_head_on_tier']}): measured {r['measured_ms']['median']:.1f} "
                  f"ms/token, forecast {r['forecast_ms']:.1f} ({r['error']:+.0%}); unsplit "
                  f"{r['unsplit_ms']:.1f} ms/token")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
