"""`ember bench decode`: prefill and decode tokens/s, optionally beside llama.cpp.

Both engines run the same prompt ids (greedy, EOS ignored) in the same process, interleaved
run by run, so machine noise hits both alike; the ratios are what to read. Each figure is
reported as min/median/max over the runs. Ember's report also gives the bytes of weights a
decode step reads times its median tokens/s, as a fraction of a large tensor copy's bandwidth
measured in the same process (bytes read + written per second); near 1 means decoding streams
its weights about as fast as memory moves bytes at all.
"""

from __future__ import annotations

import statistics
import time

from ember.models.support.errors import EmberError

from ..progress import progress_bar
from .common import load_engine, model_path, print_json

SEED_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps aloud "
    "and listening to the sea argue with the rocks below. "
)


# A paragraph that never repeats itself, for `--text prose`: prompt lookup finds nothing to
# copy in it at first (the base model's greedy continuation soon loops, though).
PROSE_TEXT = (
    "Maps were once drawn by people who had never seen the places they described. A "
    "cartographer in a northern port would copy the coastline from a sailor's sketch, add a "
    "river from a merchant's letter, and guess at the mountains from a traveller's tale. "
    "Errors travelled with the copies. An island that one captain mistook for two appeared as "
    "a pair for a century, and a lake that dried out in a hot summer stayed blue on every "
    "chart. Surveying changed this slowly. Teams with chains and brass instruments walked the "
    "land, measured the angles between hilltops, and built triangles across whole provinces. "
    "Their work was tedious and often dangerous; a single season might fix the position of a "
    "dozen villages. Yet the results were checked against each other, and the maps that "
    "followed could be trusted by engineers planning roads, canals and, later, railways. "
    "Today satellites have replaced the chains, but the habit of checking remains the heart "
    "of the craft, and"
)


def _prompt_ids(engine, n: int, text: str = "repeated") -> list[int]:
    ids = engine.encode(SEED_TEXT * (n // 8 + 2) if text == "repeated" else PROSE_TEXT)
    if len(ids) < n:
        raise EmberError(f"the {text} prompt has only {len(ids)} tokens; use --prompt-tokens "
                         f"{len(ids)} or less")
    return ids[:n]


def _ember_run(engine, ids: list[int], gen: int) -> dict:
    from ember.offload.options.sampling import GREEDY

    engine.forget("default")  # no prefix reuse between runs: time the full prefill
    done = engine.generate(ids, sampling=GREEDY, max_tokens=gen, ignore_eos=True)
    t = done.timings
    run = {"prefill": t.prefill_tokens_per_s, "decode": t.decode_tokens_per_s,
           "token_ids": done.token_ids}
    if engine.drafter is not None:
        run["accepted_length"] = engine.speculation["mean_accepted_length"]
    return run


def _settle(seconds: float = 0.5) -> None:
    """Pause between runs: both engines' worker threads spin-wait for a while after their
    last parallel region (OpenMP, ggml's pool), and would take cores from the next run."""
    time.sleep(seconds)


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes/s of a large tensor copy (bytes read + bytes written), best of `repeats`: what
    memory gives this process now, with the same threads and the same neighbours."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _bandwidth_report(engine, decode_median: float, copy_bps: float) -> dict:
    """Weights read per decode step (Ember's, and the file's own: what reading every
    projection and the LM head as stored costs) times tokens/s, against the measured copy
    bandwidth."""
    from ember.offload.body.file_layers import file_bytes_per_token

    model, source = engine.model, engine.loaded.source
    per_token = model.weight_bytes_per_token()
    file_per_token = file_bytes_per_token(source.config, source.weights)
    achieved = per_token * decode_median
    from ember.models.ram_copy import huge_page_bytes

    in_ram = source.weights.in_ram
    return {"weights": engine.weights, "lm_head": engine.lm_head,
            # Where the file's bytes were read from: a RAM copy on huge pages or the map
            # (llama.cpp's default, and what it runs on here).
            "weights_in": "ram" if in_ram else "mmap",
            "huge_page_bytes": huge_page_bytes() if in_ram else None,
            "weight_bytes_per_token": per_token, "file_bytes_per_token": file_per_token,
            "bytes_ratio_to_file": per_token / file_per_token,
            "weight_gb_per_s": achieved / 1e9,
            "copy_gb_per_s": copy_bps / 1e9, "fraction_of_copy_bandwidth": achieved / copy_bps}


def _cpu_report() -> dict:
    """Which kernel path the figures were measured on (EMBER_CPU_PATH forces one) and which
    this build and CPU could run: the machine kind a ratio belongs to."""
    from ember.kernels import block_matmul as bm

    return {"path": bm.cpu_path(), "paths": list(bm.cpu_paths())}


def run(args) -> int:
    if args.runs < 1 or args.gen_tokens < 2 or args.prompt_tokens < 1:
        raise EmberError("--runs must be >= 1, --gen-tokens >= 2, --prompt-tokens >= 1")
    engine = load_engine(args)
    ids = _prompt_ids(engine, args.prompt_tokens, args.text)
    import dataclasses

    import torch

    from ember.offload.runtime.engine import Engine

    threads = torch.get_num_threads()
    # Ember with each drafter asked for, on the same loaded model (speculation is lossless:
    # their tokens must equal plain decoding's, which is checked below).
    engines = {"ember": engine}
    for name in args.drafters:
        engines[f"ember+{name}"] = Engine(engine.loaded,
                                          dataclasses.replace(engine.options, speculate=name))
    other = None
    if args.against:
        from ember.app.baseline import LlamaCpp, layers_in_budget

        # With a GPU budget, llama.cpp gets the layers the same budget holds (-ngl)
        budget = engine.options.gpu_budget
        ngl = 0 if budget is None else layers_in_budget(engine.loaded.source, budget,
                                                         engine.n_ctx)
        # the same KV cache type (a Q8_0 cache turns llama.cpp's flash attention on)
        other = LlamaCpp(model_path(args), threads, args.prompt_tokens + args.gen_tokens + 16,
                         n_gpu_layers=ngl, kv_type=engine.options.kv_type)
    for e in engines.values():
        _ember_run(e, ids[:8], 4)  # warm-up: first-call allocations, page faults
    if other:
        other.decode_speed(ids[:8], 4)
    results = {name: [] for name in engines} | {"llama.cpp": []}
    copy_bps = copy_bandwidth()
    total = args.runs * (len(engines) + (other is not None))
    with progress_bar("bench decode", args.json, total=total, unit="runs") as bar:
        for i in range(args.runs):
            for name, e in engines.items():
                _settle()
                results[name].append(_ember_run(e, ids, args.gen_tokens))
                bar(sum(map(len, results.values())) / total, f"run {i + 1} of {args.runs}")
            if other:
                _settle()
                results["llama.cpp"].append(other.decode_speed(ids, args.gen_tokens))
                bar(sum(map(len, results.values())) / total, f"run {i + 1} of {args.runs}")
    report = {
        "model": str(model_path(args)),
        "threads": threads,
        "text": args.text,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "runs": args.runs,
    }
    for name, runs in results.items():
        if runs:
            report[name] = {k: _stats([r[k] for r in runs]) for k in ("prefill", "decode")}
    plain_ids = results["ember"][0]["token_ids"]
    for name in engines:
        if name != "ember":
            report[name]["mean_accepted_length"] = statistics.mean(
                r["accepted_length"] for r in results[name])
            report[name]["identical_to_plain"] = all(
                r["token_ids"] == plain_ids for r in results[name])
            report[name]["speedup_over_plain"] = (report[name]["decode"]["median"]
                                                  / report["ember"]["decode"]["median"])
    copy_bps = max(copy_bps, copy_bandwidth())  # before and after the runs: the better one
    report["ember"]["bandwidth"] = _bandwidth_report(
        engine, report["ember"]["decode"]["median"], copy_bps)
    # A split engine's plan, tier formats and per-layer hot/cold/wait times (None unsplit).
    report["ember"]["hybrid"] = engine.hybrid_report()
    report["ember"]["cpu"] = _cpu_report()
    if other:
        report["llama.cpp"]["kv_type"] = other.kv_type
        report["llama.cpp"]["flash_attn"] = other.flash_attn
        report["llama.cpp"]["n_gpu_layers"] = other.n_gpu_layers
        report["llama.cpp"]["gpu_offload"] = other.gpu_offload
        ratio = {k: report["ember"][k]["median"] / report["llama.cpp"][k]["median"]
                 for k in ("prefill", "decode")}
        for name in engines:
            if name != "ember":
                ratio[f"decode_{name}"] = (report[name]["decode"]["median"]
                                           / report["llama.cpp"]["decode"]["median"])
        report["ratio_ember_over_llama_cpp"] = ratio
    print_json(report)
    return 0
