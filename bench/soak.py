"""Soak: many chat turns across several conversations with KV swaps; RSS must not grow.

    .venv/bin/python -m bench.soak [--turns 500] [--conversations 5] [--model PATH | --tiny]

Conversations take turns round-robin through one engine whose device KV pool holds about one
of them, so nearly every turn swaps one conversation out and another in (or recomputes a
dropped one). A conversation that nears the context limit starts over, as a user opening a
new chat would. Prints one JSON object: RSS after warm-up and at the end, its growth, turns,
swaps, drops, and time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from ember.models.chat_format import ChatMessage
from ember.models.default_model import default_model_path
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.kv.plan import plan_kv
from ember.offload.body.file_blocks_model import kv_dtype
from ember.offload.options.sampling import SamplingParams

USER_LINES = [
    "Tell me about rivers.", "What do herons eat?", "Why do meadows flood in spring?",
    "Summarise that in one line.", "Give me three facts about bridges.",
    "How are barges loaded?", "What is a weir?", "Write a short poem about fog.",
]


def _tiny_model(folder: Path) -> Path:
    from ember.models.testing import synthetic

    cfg = synthetic.tiny_config("gemma3")
    return synthetic.write_gguf(folder / "tiny.gguf", cfg, synthetic.tiny_weights(cfg, 0))


def swapping_engine(loaded, n_ctx: int, threads: int | None = None) -> Engine:
    """An engine whose device KV pool holds about one full conversation (host: two), so
    round-robin turns swap and, once the host fills, drop and recompute."""
    options = EngineOptions(device="cpu", n_ctx=n_ctx, threads=threads,
                            # the family format: short turns (a base model's transcript
                            # preamble alone would nearly fill a tiny model's context)
                            chat_format="gemma")
    value_bytes = kv_dtype(options, torch.device("cpu")).itemsize
    plan = plan_kv(loaded.config, n_ctx, value_bytes=value_bytes)
    return Engine(loaded, dataclasses.replace(
        options, kv_budget=plan.min_device_blocks * plan.block_bytes,
        kv_host_budget=2 * plan.min_device_blocks * plan.block_bytes))


def soak(engine: Engine, turns: int, conversations: int, max_tokens: int,
         warmup: int = 10) -> dict:
    proc = psutil.Process()
    history: dict[int, list[ChatMessage]] = {c: [] for c in range(conversations)}
    sampling = SamplingParams(temperature=0.8, seed=0)
    rss_start = None
    curve = []  # RSS every `turns // 10` turns: a leak climbs, a warming pool levels off
    t0 = time.perf_counter()
    for turn in range(turns):
        if turn == warmup:
            _touch_pools(engine)
            gc.collect()
            rss_start = proc.memory_info().rss
        if turn % max(1, turns // 10) == 0:
            curve.append(round(proc.memory_info().rss / 2**20, 1))
        c = turn % conversations
        msgs = history[c] + [ChatMessage("user", USER_LINES[turn % len(USER_LINES)])]
        ids = engine.encode_chat(msgs)
        if len(ids) + max_tokens >= engine.n_ctx:  # full: the user starts a new chat
            msgs = msgs[-1:]
            ids = engine.encode_chat(msgs)
        done = engine.generate(ids, sampling=sampling, max_tokens=max_tokens,
                               session=f"conversation-{c}")
        history[c] = msgs + [ChatMessage("assistant", done.text)]
    gc.collect()
    rss_end = proc.memory_info().rss
    usage = engine.kv_usage()
    return {
        "turns": turns, "conversations": conversations, "seconds": time.perf_counter() - t0,
        "rss_start_mib": rss_start / 2**20, "rss_end_mib": rss_end / 2**20,
        "rss_growth_mib": (rss_end - rss_start) / 2**20,
        "rss_curve_mib": curve,
        # Resident from the start of measuring (see _touch_pools): not part of the growth.
        "kv_pool_mib": (usage["plan"]["device_bytes"] + usage["plan"]["host_bytes"]) / 2**20,
        "swaps_out": usage["swaps_out"], "swaps_in": usage["swaps_in"],
        "dropped": usage["dropped"],
    }


def _touch_pools(engine: Engine) -> None:
    """Make every KV pool page resident before measuring. The pools are allocated empty
    (untouched host pages cost no RAM), so without this the first swaps into fresh blocks
    show up as growth of up to the pools' size, which is not a leak. Writing zeros into free
    blocks changes nothing the engine reads: only written slots are ever read."""
    kv = engine.kv
    for pool in filter(None, (kv.device_pool, kv.host_pool, kv.host_layer_pool)):
        for block, refs in enumerate(pool.allocator.refs):
            if refs == 0:
                pool.k[block].zero_()
                pool.v[block].zero_()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=500)
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ctx-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH")
    src.add_argument("--tiny", action="store_true", help="a tiny synthetic model (fast)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_model(Path(tmp)) if args.tiny else (args.model or default_model_path())
        engine = swapping_engine(load_model(path), args.ctx_size, args.threads)
        report = soak(engine, args.turns, args.conversations, args.max_tokens)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
