"""`ember bench sparsity`: decode tokens/s, dense against input-thresholded, interleaved in one
run, on the file's blocks.

Thresholds come from the model's profile (`--profile PATH`, what `ember profile` calibrated)
or, per `--sparsity` target, from a short pass over the prompt: each matmul input's threshold is
its |x| quantile at the target (uniform over the body's matmuls; for timing random-weight
models, whose quality means nothing). Each run decodes `--gen-tokens` greedy tokens after the
prompt, dense then each threshold set, so a busy spell on a shared machine hits all. Reported
beside each speedup: the ideal one from bytes, weight bytes a dense token reads (LM head and
body, on the file) over the bytes the thresholded token read (the realized sparsity times the
input-major bytes, plus the untouched rest).
"""

from __future__ import annotations

import statistics

from .common import model_path, print_json


def run(args) -> int:
    import torch

    from ember.models.support.errors import ConfigError
    from ember.models.loader import open_model
    from ember.offload.runtime.device import set_threads
    from ember.offload.profile.input_calibration import collect_slot_stats
    from ember.offload.profile.input_payoff import decode_seconds
    from ember.offload.body.input_sparsity import SLOTS, apply_input_sparsity
    from ember.offload.body.file_blocks_model import FileBlocksModel, applies

    if not applies():
        raise ConfigError("ember bench sparsity needs Ember's C++ CPU kernels (a C++ compiler "
                          "at first use)")
    if any(not 0 < s < 1 for s in args.sparsity):
        raise ConfigError("--sparsity targets must be between 0 and 1, e.g. 0.4 0.5")
    set_threads(args.threads)
    source = open_model(model_path(args))
    model = FileBlocksModel.plain(source)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
    sets = {}
    if args.profile:
        from ember.offload.runtime.profile_file import load_profile

        profile = load_profile(args.profile, model.cfg, source.fingerprint)
        if "input_thresholds" not in profile.meta:
            raise ConfigError(f"{args.profile} holds no input thresholds (made for a "
                              f"ReLU-family model or with a GPU budget)")
        sets["profile"] = profile.meta["input_thresholds"]
    if args.sparsity:
        stats = collect_slot_stats(model, prompt, None, len(prompt))
        for s in args.sparsity:
            sets[f"{s:.0%}"] = [{slot: stats[(i, slot)].threshold(s) for slot in SLOTS}
                                for i in range(len(model.layers))]
    runtime = apply_input_sparsity(model, [{} for _ in model.layers])
    times: dict[str, list[float]] = {"dense": []} | {k: [] for k in sets}
    realized, body = {}, {}
    for _ in range(args.runs):
        for name in times:
            runtime.set_thresholds([{} for _ in model.layers] if name == "dense" else sets[name])
            runtime.reset_counters()
            times[name].append(decode_seconds(model, prompt, args.gen_tokens, runtime))
            if name != "dense":
                realized[name] = runtime.realized()
                body[name] = runtime.bytes_per_token()
    result = _report(model, times, realized, body, args)
    result["tile_bytes"] = runtime.layout_bytes()
    print_json(result)
    return 0


def _report(model, times, realized, body, args) -> dict:
    head = model.head.stored.nbytes
    dense_s = statistics.median(times["dense"])
    out = {"model": str(model_path(args)), "threads": args.threads, "runs": args.runs,
           "layout": "tiles",
           "gen_tokens": args.gen_tokens, "dense_tok_s": round(1 / dense_s, 2),
           "dense_tok_s_runs": [round(1 / t, 2) for t in times["dense"]], "thresholded": {}}
    for name, ts in times.items():
        if name == "dense":
            continue
        dense_body, read_body = body[name]
        ideal = (head + dense_body) / (head + read_body)
        speedup = dense_s / statistics.median(ts)
        out["thresholded"][name] = {
            "tok_s": round(1 / statistics.median(ts), 2),
            "tok_s_runs": [round(1 / t, 2) for t in ts],
            "speedup": round(speedup, 3), "ideal_speedup_from_bytes": round(ideal, 3),
            "fraction_of_ideal": round((speedup - 1) / (ideal - 1), 3) if ideal > 1 else None,
            "speedup_over_ideal": round(speedup / ideal, 3),
            "mean_sparsity_body": realized[name]["mean_body"],
            "body_bytes_dense": dense_body, "body_bytes_read": read_body, "head_bytes": head}
    return out
