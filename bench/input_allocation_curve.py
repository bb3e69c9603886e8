"""Where the perplexity goes as input sparsity rises: `python -m bench.input_allocation_curve`.

Calibration text: the model's own continuations of Ember's seed prompts (what `ember profile`
samples when given no text), or `--calibration FILE`; held-out text: `--held-out FILE`
(default tests/data/english.txt), disjoint from it. Prints, as JSON:
- per slot kind (qkv, o, gate_up, down), every layer's slot of that kind at each level, the
  rest dense: held-out perplexity ratio (which matmuls resist);
- per layer and slot, the KL from the dense model at the probe level (calibration text);
- for each allocation (uniform, per-block greedy, global greedy) and target: the planned and
  realized mean sparsity over the body's matmuls, held-out perplexity ratio and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.models.default_model import default_model_path
from ember.models.loader import load_model
from ember.offload.body.input_sparsity import SLOTS, apply_input_sparsity
from ember.offload.body.quant_model import QuantModel
from ember.offload.profile import input_calibration as ic
from ember.offload.profile.input_allocation import KL_TOKENS, PROBE_EVERY, PROBES
from ember.predictors.passes import score

LENGTH = 512


def texts(loaded, args) -> tuple[list[int], list[int]]:
    tok = loaded.tokenizer
    held = tok.encode(Path(args.held_out).read_text(encoding="utf-8"), add_bos=False)
    if args.calibration:
        return [t for name in args.calibration
                for t in tok.encode(Path(name).read_text(encoding="utf-8"), add_bos=False)], held
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():
        return json.loads(cache.read_text()), held
    from ember.offload.profile.profiler import ProfileOptions, calibration_ids

    text = calibration_ids(loaded, ProfileOptions(sample_tokens=args.sample_tokens),
                           lambda stage, msg: None)
    train = text.train + text.held_out  # all of it is calibration here; english.txt is held out
    if cache:
        cache.write_text(json.dumps(train))
    return train, held


def at_budget(plan, held_out, budget: float, steps: int = 7) -> dict:
    """The highest target whose held-out perplexity stays within 1 + budget (bisected)."""
    lo, hi, best = 0.0, 0.6, {"target": 0.0}
    for _ in range(steps):
        mid = (lo + hi) / 2
        row = {"target": round(mid, 4), **held_out(plan(mid).thresholds)}
        lo, hi = (mid, hi) if row["ppl_ratio"] <= 1 + budget else (lo, mid)
        if row["ppl_ratio"] <= 1 + budget:
            best = row
    return {"budget": budget, **best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--calibration", nargs="+", help="calibration text files (default: "
                                                    "model-sampled)")
    p.add_argument("--cache", help="keep the sampled calibration ids in this JSON file")
    p.add_argument("--sample-tokens", type=int, default=2000)
    p.add_argument("--held-out", default=str(Path(__file__).parents[1] / "tests/data/english.txt"))
    p.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    p.add_argument("--methods", nargs="+", default=list(ic.ALLOCATIONS), choices=ic.ALLOCATIONS)
    p.add_argument("--slot-levels", type=float, nargs="*", default=[0.3, 0.5, 0.7])
    p.add_argument("--probes", type=float, nargs="+", default=list(PROBES),
                   help="levels at which the global allocation measures each slot's KL")
    p.add_argument("--kl-tokens", type=int, default=KL_TOKENS)
    p.add_argument("--probe-every", type=int, default=PROBE_EVERY,
                   help="probe every N-th layer (and the last); the others are interpolated")
    p.add_argument("--budget", type=float, default=0.03,
                   help="also bisect each method's target to this held-out perplexity increase")
    args = p.parse_args()

    loaded = load_model(args.model or default_model_path())
    model, bos = QuantModel(loaded.source), loaded.tokenizer.bos_id
    train, held = texts(loaded, args)
    out = {"calibration_tokens": len(train), "held_out_tokens": len(held)}
    stats = ic.collect_slot_stats(model, ic.spread(train, ic.STATS_TOKENS, LENGTH - 1), bos,
                                  LENGTH)
    dense = score(model, held, LENGTH, bos)
    n = len(model.layers)
    runtime = apply_input_sparsity(model, [{} for _ in range(n)])

    def held_out(alloc_thresholds) -> dict:
        runtime.set_thresholds(alloc_thresholds)
        runtime.reset_counters()
        s = score(model, held, LENGTH, bos)
        means = ic.realized_means(runtime)
        return {"ppl_ratio": round(s.ppl / dense.ppl, 4),
                "agreement": round(dense.agreement(s), 4),
                "realized_mean_body": means["mean_body"],
                "realized_mean_body_by_bytes": means["mean_body_by_bytes"]}

    out["per_slot_kind"] = {
        slot: {lv: held_out([{slot: stats[(i, slot)].threshold(lv)} for i in range(n)])
               for lv in args.slot_levels} for slot in SLOTS}
    print(json.dumps(out["per_slot_kind"]), flush=True)
    log: list[str] = []
    curves = {}
    for method in args.methods:
        plan = ic.allocator(method, model, runtime, stats, train, bos, LENGTH, log.append,
                            tuple(sorted(args.probes)), args.kl_tokens, args.probe_every)
        curves[method] = []
        for target in args.targets:
            alloc = plan(target)
            row = {"target": target, "planned": round(alloc.mean_sparsity(), 4),
                   **held_out(alloc.thresholds)}
            if target == args.targets[-1] or abs(target - 0.4) < 1e-9:
                row["levels"] = alloc.levels
            curves[method].append(row)
            print(method, json.dumps({k: v for k, v in row.items() if k != "levels"}), flush=True)
        if args.budget:
            curves[method].append(at_budget(plan, held_out, args.budget))
            print(method, "at budget", json.dumps(curves[method][-1]), flush=True)
    out["probe_kl"] = log
    out["curves"] = curves
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
