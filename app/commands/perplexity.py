"""`ember perplexity FILE`: the file as one sequence with BOS first."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ember.models.support.errors import EmberError

from .common import load_engine, print_json


def run(args) -> int:
    from ember.offload.profile.perplexity import perplexity

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EmberError(f"{path}: cannot read the text file ({exc})") from None
    engine = load_engine(args)
    ids = engine.tokenizer.encode(text, add_bos=False)
    if len(ids) < 2:
        raise EmberError(f"{path}: the text has {len(ids)} tokens; perplexity needs at least 2")
    t0 = time.perf_counter()
    result = perplexity(engine.model, ids, engine.tokenizer.bos_id, window=engine.n_ctx,
                        stride=args.stride)
    seconds = time.perf_counter() - t0
    report = {"tokens": result.tokens, "ppl": result.ppl, "window": engine.n_ctx,
              "seconds": seconds}
    if args.against:
        import torch

        from ember.app.baseline import LlamaCpp

        # the same KV cache type (a Q8_0 cache turns llama.cpp's flash attention on)
        other = LlamaCpp(engine.loaded.source.path, torch.get_num_threads(), engine.n_ctx,
                         logits_all=True, kv_type=engine.options.kv_type)
        theirs = other.perplexity(ids, engine.tokenizer.bos_id, engine.n_ctx, args.stride)
        report["llama.cpp"] = {"tokens": theirs.tokens, "ppl": theirs.ppl,
                               "kv_type": other.kv_type}
        report["ratio_ember_over_llama_cpp"] = result.ppl / theirs.ppl
    if args.json:
        print_json(report)
    else:
        print(f"{result.ppl:.4f}" + (f"  (llama.cpp {report['llama.cpp']['ppl']:.4f})"
                                     if args.against else ""))
        print(f"ember: {result.tokens} tokens scored in {seconds:.1f} s (window {engine.n_ctx})",
              file=sys.stderr)
    return 0
