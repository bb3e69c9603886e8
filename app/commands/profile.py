"""`ember profile`: prepare a model for sparse, hybrid decoding; writes one artifact."""

from __future__ import annotations

import sys
import time

from ..progress import stage_bars
from .common import model_path, print_json


def run(args) -> int:
    from ember.models.loader import load_model
    from ember.offload.runtime.device import set_threads
    from ember.offload.runtime.profile_file import default_profile_path
    from ember.offload.profile.profiler import ProfileOptions, run_profile
    from ember.models.support.sizes import parse_size

    options = ProfileOptions(
        texts=tuple(args.text or ()), held_out_texts=tuple(args.held_out or ()),
        sample_tokens=args.sample_tokens,
        gpu_budget=None if args.gpu_budget is None else parse_size(args.gpu_budget, "--gpu-budget"),
        quality_budget=args.quality_budget / 100, recall=args.recall, seed=args.seed,
        epochs=args.epochs)
    set_threads(args.threads)
    started = time.perf_counter()
    print("ember: loading model…", file=sys.stderr, flush=True)
    with stage_bars(args.json) as bars:
        # The float model is built (layer by layer) when the profiler first asks for it.
        loaded = load_model(model_path(args),
                            progress=lambda fraction, stage: bars(fraction, f"loading: {stage}"))
        out = args.output or default_profile_path(loaded.source.fingerprint)

        def say(stage: str, message: str) -> None:
            bars.write(f"ember: [{time.perf_counter() - started:6.1f} s] {stage}: {message}")

        report = run_profile(loaded, out, options, say, bars)
    if args.json:
        print_json(report.to_dict())
    else:
        _summary(report)
    return 0


def _summary(report) -> None:
    q = report.quality
    print(f"profile written to {report.path}")
    cal = report.calibration
    print(f"  calibration     {cal['train_tokens']} training tokens "
          f"({', '.join(cal.get('files') or []) or cal['source']}) + {cal['held_out_tokens']} "
          f"held-out ({', '.join(cal.get('held_out_files') or []) or cal['held_out_source']})")
    if report.glu and report.glu.get("method") == "input thresholds":
        _input_summary(report)
        return
    if report.glu:
        print(f"  GLU thresholds  mean sparsity {report.glu['mean_sparsity']:.1%}, "
              f"held-out perplexity x{report.glu['ppl_ratio']:.3f}")
    gated = sum(1 for p in report.predictors if not p["dense"])
    print(f"  predictors      {gated} of {len(report.predictors)} layers gated "
          "(the rest run dense: a predictor would cost more than it saves)")
    for p in report.predictors:
        if not p["dense"]:
            print(f"    layer {p['layer']:>3}: rank {p['rank']:>4}  recall {p['recall']:.3f}  "
                  f"precision {p['precision']:.3f}  predicted active {p['predicted_fraction']:.1%}")
    if report.placement.get("ilp"):
        ilp = report.placement["ilp"]
        print(f"  placement       ILP {ilp['objective_ms']:.3f} ms/token (greedy "
              f"{report.placement['greedy_objective_ms']:.3f}), hot {ilp['hot_fraction']:.1%}, "
              f"solved in {ilp['solve_s']:.2f} s ({ilp['status']})")
    print(f"  quality         held-out perplexity {q['dense_ppl']:.3f} -> {q['sparse_ppl']:.3f} "
          f"(x{q['ppl_ratio']:.3f}), top-1 agreement {q['top1_agreement']:.1%}, greedy match "
          f"{q['greedy_match_tokens']}/{q['greedy_tokens']} tokens")
    if q["sparsity"] is not None:
        print(f"  sparsity        {q['sparsity']:.1%} of FFN neurons skipped per decoded token")
    _print_stages(report)


def _input_summary(report) -> None:
    """GLU models: thresholds on every matmul's input (no predictors, no placement)."""
    q, glu = report.quality, report.glu
    realized = q["input_sparsity"]
    print(f"  input thresholds planned mean sparsity {glu['planned_mean_sparsity']:.1%} over the "
          f"body's matmuls, chosen on {glu['search_tokens']} calibration tokens set aside "
          f"(perplexity x{glu['ppl_ratio']:.3f} there)")
    print("  tried           target: realized mean over the 7 matmuls (by bytes), perplexity "
          "and top-1 agreement, all on the calibration text set aside")
    for row in sorted(glu["tried"], key=lambda r: r["target"]):
        print(f"    {row['target']:6.1%}: {row['mean_body']:5.1%} "
              f"({row['mean_body_by_bytes']:5.1%}), x{row['search_ppl_ratio']:.3f}, "
              f"{row['search_agreement']:.1%}")
    print(f"  quality         held-out perplexity {q['dense_ppl']:.3f} -> {q['sparse_ppl']:.3f} "
          f"(x{q['ppl_ratio']:.3f}), top-1 agreement {q['top1_agreement']:.1%}, greedy match "
          f"{q['greedy_match_tokens']}/{q['greedy_tokens']} tokens")
    print(f"  sparsity        {realized['mean_body']:.1%} mean over the body's 7 matmuls "
          f"({q['sparsity_by_bytes']:.1%} weighted by their bytes), realized while decoding "
          f"({realized['mean_thresholded']:.1%} over the thresholded slots; "
          f"{q['held_out_sparsity']:.1%} ({q['held_out_sparsity_by_bytes']:.1%} by bytes) while "
          "scoring the held-out text)")
    for i, row in enumerate(realized["per_layer"]):
        print(f"    layer {i:>3}: " + "  ".join(f"{k} {v:.0%}" for k, v in row.items()))
    pay = glu.get("payoff")
    if pay is not None:
        alone = ", ".join(f"{s} {v['speedup']:.2f}x" if v["timed"] else
                          f"{s} not timed (it skips {v['bytes_skipped']:.1%} of a token's bytes, "
                          f"its matmuls save {v['matmul_saving']:.1%} of its time)"
                          for s, v in pay["slots"].items())
        runs = ", ".join(pay["pays"]) if pay["pays"] else "none: decoding stays dense"
        print(f"  payoff          decode {pay['dense_tok_s']} tok/s dense; each slot thresholded "
              f"alone: {alone}. Applied by default (--ffn-mode auto): {runs}; --ffn-mode "
              f"sparse applies every slot")
    _print_stages(report)


def _print_stages(report) -> None:
    times = report.stages_s
    print("  stages          " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
          + f" (in all {sum(times.values()):.1f} s)")
