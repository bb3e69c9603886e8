"""`ember bench context`: prefill and decode after long prompts of real text (Python source
from the standard library, cut to N tokens), Ember beside llama.cpp with flash attention off
and on and the same KV cache type (`--kv-type q8_0`: llama.cpp's Q8_0 cache, which it keeps
only with flash attention, so that run alone), interleaved length by length in the same
process (as `bench decode`), and the decode attention's time per token against its two
bounds: the KV bytes it reads over the copy bandwidth, and its multiply-adds over the same
kernel's rate on a context that fits in cache.
The attention is timed on the kernel as a decode step meets it (every layer's own K/V in
turn: from memory once they outgrow the caches) and in cache; beside it, what the longer
context adds to a real decode step (its time per token over the shortest prompt's).
"""

from __future__ import annotations

import inspect
import statistics
import time

from ember.models.support.errors import EmberError

from ..progress import progress_bar
from .bench_decode import _cpu_report, _ember_run, _settle, _stats, copy_bandwidth
from .common import load_engine, model_path, print_json

# Large, stable standard-library modules: real code, the same text on every machine.
SOURCE_MODULES = ("inspect", "typing", "argparse", "subprocess", "pathlib", "tarfile")
STEP_POOL_BYTES = 512 << 20  # K/V the decode-step timing cycles through (far past any L3)


def source_text(min_chars: int) -> str:
    """The modules' sources one after another, repeated until at least min_chars long."""
    parts = []
    for name in SOURCE_MODULES:
        module = __import__(name)
        with open(inspect.getsourcefile(module), encoding="utf-8") as f:
            parts.append(f.read())
    text = "\n".join(parts)
    return text * (min_chars // len(text) + 1)


def _prompts(engine, lengths: list[int]) -> dict[int, list[int]]:
    longest = max(lengths)
    ids = engine.encode(source_text(longest * 6))
    if len(ids) < longest:
        raise EmberError(f"the source text has only {len(ids)} tokens; ask for fewer")
    return {n: ids[:n] for n in lengths}


def _attention_layers(cfg, n: int) -> list[int]:
    """Keys a decoded token at position n reads in each layer (its window where it has one)."""
    return [n + 1 if cfg.window(i) is None else min(n + 1, cfg.window(i))
            for i in range(cfg.n_layers)]


def _time_attend(q, k_pool, v_pool, keys: int, repeats: int = 9, pick=statistics.median) -> float:
    """Seconds of one decoded row's attention over `keys` keys (the median of the repeats, or
    what `pick` takes), the same K/V every time (after the first call they are in cache
    where they fit)."""
    import torch

    from ember.kernels.attention import attend

    slots, pos = [torch.arange(keys)], torch.tensor([keys - 1])
    attend(q, k_pool, v_pool, slots, pos, 0.1)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        attend(q, k_pool, v_pool, slots, pos, 0.1)
        times.append(time.perf_counter() - t)
    return pick(times)


def _kernel_rate(q, k_pool, v_pool, small: int = 1024, rounds: int = 15) -> float:
    """Multiply-adds a second of the decode attention in cache: the extra work of 2 x `small`
    keys over `small` keys by the extra time. The difference drops a call's fixed cost (the
    parallel region, Python: ~20 us, a third of a 1,024-key call), which a call's own rate
    counted as arithmetic. The two lengths alternate, each round's pair the faster of 3
    calls, and the median round is taken: the host's drift falls on both sides of a pair."""
    n_heads, hd = q.shape[1], q.shape[2]
    macs = 2 * n_heads * hd  # a key's q.k and p.v for every query head
    rates = []
    for _ in range(rounds):
        t_small = _time_attend(q, k_pool, v_pool, small, repeats=3, pick=min)
        t_large = _time_attend(q, k_pool, v_pool, 2 * small, repeats=3, pick=min)
        if t_large > t_small:
            rates.append(small * macs / (t_large - t_small))
        else:  # noise larger than the difference: the longer call's own rate
            rates.append(2 * small * macs / t_large)
    return statistics.median(rates)


def _time_step(q, pools, keys: list[int], repeats: int = 5) -> float:
    """Median seconds of one decoded token's attention in every layer as a decode step meets
    it: each layer reads its own K/V in turn, so once they outgrow the caches every read
    comes from memory."""
    import torch

    from ember.kernels.attention import attend

    rows = [([torch.arange(n)], torch.tensor([n - 1])) for n in keys]
    totals = []
    for _ in range(repeats + 1):  # the first pass warms the code, not the data
        t = time.perf_counter()
        for (k_pool, v_pool), (slots, pos) in zip(pools, rows):
            attend(q, k_pool, v_pool, slots, pos, 0.1)
        totals.append(time.perf_counter() - t)
    return statistics.median(totals[1:])


def _pool(values, dtype):
    """Random K or V values (S, n_kv, hd) as a pool of the engine's type (uint8: Q8_0), on
    huge pages where big, as the engine's pool is (offload/kv/blocks.py)."""
    import torch

    from ember.kernels.page_advice import empty_on_huge_pages
    from ember.kernels.q8_matmul import q8_0_quantize

    s, n_kv, hd = values.shape
    if dtype == torch.uint8:
        values = q8_0_quantize(values.reshape(-1, hd)).reshape(s, n_kv, -1)
    pool = empty_on_huge_pages(tuple(values.shape), dtype)
    return pool.copy_(values)


def attention_report(engine, n: int, copy_bps: float) -> dict:
    """Decode attention per token after n tokens, with the model's shapes and the engine's KV
    type: timed as a decode step meets it (`_time_step`: every layer's K/V in turn) and,
    beside it, with one layer's K/V read again and again (in cache where it fits).
    The bound is max(KV bytes / copy bandwidth, multiply-adds / the kernel's in-cache
    rate, `_kernel_rate`); beside it a float32 matmul's rate on the same threads (the machine's
    multiply-add peak, near enough)."""
    import torch

    cfg = engine.loaded.config
    hd, n_kv, n_heads = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
    keys = _attention_layers(cfg, n)
    longest = max(keys)
    # Enough distinct K/V to outgrow any cache (every layer's, up to STEP_POOL_BYTES), taken
    # in turn: a 7B at 12k would otherwise hold a second 6 GB of K/V for this report.
    layer_bytes = 2 * _pool(torch.zeros(1, n_kv, hd), engine.kv_dtype).nbytes * longest
    distinct = max(1, min(len(keys), -(-STEP_POOL_BYTES // layer_bytes)))
    made = [tuple(_pool(torch.randn(longest, n_kv, hd), engine.kv_dtype) for _ in "kv")
            for _ in range(distinct)]
    pools = [made[i % distinct] for i in range(len(keys))]
    q = torch.randn(1, n_heads, hd)
    seconds = _time_step(q, pools, keys)
    per_keys = {k: _time_attend(q, *made[0], k) for k in set(keys)}
    in_cache = sum(per_keys[k] for k in keys)
    keys_total = sum(keys)
    kv_bytes = keys_total * 2 * made[0][0][0].nbytes
    macs = keys_total * 2 * n_heads * hd  # q.k and p.v
    # The kernel's rate in cache between 1,024 and 2,048 keys, whatever the context's length:
    # at a short context's own length a call's fixed cost would pass for the rate.
    rate_keys = 2048
    rate_pools = made[0] if longest >= rate_keys else tuple(
        _pool(torch.randn(rate_keys, n_kv, hd), engine.kv_dtype) for _ in "kv")
    peak = _kernel_rate(q, *rate_pools, small=rate_keys // 2)
    bound = max(kv_bytes / copy_bps, macs / peak)
    return {"ms_per_token": seconds * 1e3, "in_cache_ms_per_token": in_cache * 1e3,
            "kv_bytes_per_token": kv_bytes, "kv_gb_per_s": kv_bytes / seconds / 1e9,
            "macs_per_token": macs, "kernel_gmacs_in_cache": peak / 1e9,
            "matmul_gmacs": _matmul_rate() / 1e9, "gmacs_per_s": macs / seconds / 1e9,
            "bound_ms": bound * 1e3, "over_bound": seconds / bound}


def _matmul_rate(n: int = 512, repeats: int = 9) -> float:
    """Multiply-adds per second of a float32 (n, n) @ (n, n) matmul, the best of `repeats`."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return n ** 3 / best


def _llama_runs(args, threads: int, n_ctx: int, kv_type: str) -> dict:
    """llama.cpp with Ember's cache type, flash attention off and on where it can."""
    from ember.app.baseline import LlamaCpp, flash_variants

    return {name: LlamaCpp(model_path(args), threads, n_ctx, flash_attn=flash, kv_type=kv_type)
            for name, flash in flash_variants(kv_type).items()}


def _ratios(report: dict, n: int, others) -> dict:
    ours, out = report["ember"][str(n)], {}
    for phase in ("prefill", "decode"):
        best = max(report[name][str(n)][phase]["median"] for name in others)
        out[phase] = ours[phase]["median"] / best
    return out


def run(args) -> int:
    lengths = sorted(set(args.prompt_tokens))
    if args.runs < 1 or args.gen_tokens < 2 or lengths[0] < 1:
        raise EmberError("--runs must be >= 1, --gen-tokens >= 2, --prompt-tokens >= 1")
    args.ctx_size = max(args.ctx_size or 0, lengths[-1] + args.gen_tokens + 16)
    engine = load_engine(args)
    if lengths[-1] + args.gen_tokens > engine.loaded.config.context_length:
        raise EmberError(f"{lengths[-1]} prompt tokens and {args.gen_tokens} generated exceed "
                         f"the model's context of {engine.loaded.config.context_length}")
    import torch

    threads = torch.get_num_threads()
    prompts = _prompts(engine, lengths)
    kv_type = engine.options.kv_type
    others = _llama_runs(args, threads, args.ctx_size, kv_type) if args.against else {}
    _ember_run(engine, prompts[lengths[0]][:8], 4)  # warm-up: first-call allocations
    for other in others.values():
        other.decode_speed(prompts[lengths[0]][:8], 4)
    engines = ["ember", *others]
    results = {name: {n: [] for n in lengths} for name in engines}
    copy_bps = copy_bandwidth()
    total = args.runs * len(lengths) * len(engines)
    with progress_bar("bench context", args.json, total=total, unit="runs") as bar:
        for i in range(args.runs):
            for n in lengths:
                for name in engines:
                    _settle()
                    ids = prompts[n]
                    runs = results[name][n]
                    runs.append(_ember_run(engine, ids, args.gen_tokens) if name == "ember"
                                else others[name].decode_speed(ids, args.gen_tokens))
                    done = sum(len(r) for per in results.values() for r in per.values())
                    bar(done / total, f"{n} tokens, run {i + 1} of {args.runs}")
    copy_bps = max(copy_bps, copy_bandwidth())
    report = {"model": str(model_path(args)), "threads": threads, "kv_type": str(engine.kv_dtype),
              "prompt_tokens": lengths, "gen_tokens": args.gen_tokens, "runs": args.runs,
              "text": "+".join(SOURCE_MODULES) + " source", "copy_gb_per_s": copy_bps / 1e9,
              "cpu": _cpu_report()}
    if others:
        report["llama_cpp_kv_type"] = kv_type
    for name in engines:
        report[name] = {str(n): {k: _stats([r[k] for r in results[name][n]])
                                 for k in ("prefill", "decode")} for n in lengths}
    for n in lengths:
        report["ember"][str(n)]["decode_attention"] = attention_report(engine, n, copy_bps)
        if others:
            ratios = report.setdefault("ratio_ember_over_faster_llama_cpp", {})
            ratios[str(n)] = _ratios(report, n, others)
            # tokens against its first run: flash attention off where it has one
            same = [r["token_ids"] == e["token_ids"]
                    for r, e in zip(results[next(iter(others))][n], results["ember"][n])]
            report.setdefault("same_tokens_as_llama_cpp", {})[str(n)] = all(same)
    short = lengths[0]
    step_ms = {n: 1e3 / report["ember"][str(n)]["decode"]["median"] for n in lengths}
    for n in lengths:
        report["ember"][str(n)]["decode_ms_over_shortest"] = step_ms[n] - step_ms[short]
    report["ember_decode_over_its_own_at_shortest"] = {
        str(n): report["ember"][str(n)]["decode"]["median"]
        / report["ember"][str(short)]["decode"]["median"] for n in lengths}
    print_json(report)
    return 0
