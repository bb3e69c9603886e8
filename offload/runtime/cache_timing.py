"""What the paged KV cache costs: one decode step through an engine's paged cache against
the same step through the contiguous reference cache (models/reference_cache.py), for `ember bench kv`.

Lives beside the Engine because it times the engine's own model and cache, which nothing
outside offload/ touches.
"""

from __future__ import annotations

import statistics
import time

import torch

BENCH_SESSION = "bench-cache-timing"


def step_times(engine, prompt_ids: list[int], steps: int) -> tuple[float, float]:
    """Median seconds per decode step (body + LM head) after `prompt_ids`, through the paged
    cache and through the contiguous reference cache, stepping the two alternately so drift
    hits both alike. The engine's session for it is freed afterwards."""
    model, runner = engine.model, engine.runner
    runner.reset(BENCH_SESSION)
    runner.prefill(BENCH_SESSION, prompt_ids)
    paged = engine.kv.view(runner.session(BENCH_SESSION).seq_id)
    contiguous = model.new_cache(len(prompt_ids) + steps + 1)
    model.hidden(torch.tensor(prompt_ids, device=model.device), contiguous)
    times = {"paged": [], "contiguous": []}
    try:
        for i in range(steps):
            token = torch.tensor([100 + i], device=model.device)
            for name, cache in (("paged", paged), ("contiguous", contiguous)):
                t0 = time.perf_counter()
                model.logits(model.hidden(token, cache))
                times[name].append(time.perf_counter() - t0)
    finally:
        runner.reset(BENCH_SESSION)
    return statistics.median(times["paged"]), statistics.median(times["contiguous"])
