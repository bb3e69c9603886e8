"""`ember bench kv`: what the paged KV cache costs and saves, measured in one run.

- Resuming a long conversation: swap its blocks back in (then compute one token) versus
  re-prefilling the whole conversation.
- Decode tokens/s through the paged cache versus the contiguous reference cache, at several
  context lengths (single steps alternating between the two; medians).
"""

from __future__ import annotations

import statistics
import time

import torch

from ember.models.support.errors import EmberError
from ember.offload.runtime.cache_timing import step_times

from ..progress import progress_bar
from .common import load_engine, print_json

SEED_TEXT = ("A river keeper's notebook records the height of the water, the colour of the sky "
             "and the birds that pass each morning, one line a day for many years. ")


def _prompt(engine, n: int) -> list[int]:
    ids = engine.encode(SEED_TEXT * (n // 10 + 2))[:n]
    if len(ids) < n:
        raise EmberError(f"could not build a {n}-token prompt")
    return ids


def _resume(engine, ids: list[int]) -> dict:
    engine.forget("bench")
    engine.prefill("bench", ids)
    engine.park("bench")
    t0 = time.perf_counter()
    engine.prefill("bench", ids)  # swaps in, then recomputes only the last token
    swap_in = time.perf_counter() - t0
    engine.forget("bench")
    t0 = time.perf_counter()
    engine.prefill("bench", ids)
    reprefill = time.perf_counter() - t0
    engine.forget("bench")
    return {"swap_in_s": swap_in, "reprefill_s": reprefill}


def run(args) -> int:
    if args.runs < 1 or args.steps < 1:
        raise EmberError("--runs and --steps must be at least 1")
    engine = load_engine(args)
    longest = max(args.contexts + [args.resume_tokens])
    if longest + args.steps >= engine.n_ctx:
        raise EmberError(f"--ctx-size {engine.n_ctx} is too small for {longest} + {args.steps} tokens")
    steps = args.runs + len(args.contexts)  # resume runs, then a decode series per context
    resume, decode = [], {}
    with progress_bar("bench kv", args.json, total=steps, unit="runs") as bar:
        for i in range(args.runs):
            resume.append(_resume(engine, _prompt(engine, args.resume_tokens)))
            bar((i + 1) / steps, f"resume {i + 1} of {args.runs}")
        for j, ctx in enumerate(args.contexts):
            p, c = step_times(engine, _prompt(engine, ctx), args.steps * args.runs)
            decode[str(ctx)] = {"paged_tok_s": 1 / p, "contiguous_tok_s": 1 / c,
                                "paged_over_contiguous": c / p}
            bar((args.runs + j + 1) / steps, f"decode at {ctx} tokens")
    s, r = (statistics.median(x[k] for x in resume) for k in ("swap_in_s", "reprefill_s"))
    print_json({
        "resume": {"tokens": args.resume_tokens, "swap_in_s": s, "reprefill_s": r,
                   "speedup": r / s},
        "decode": decode,
        "runs": args.runs,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "kv": engine.kv_usage(),
    })
    return 0
