"""`ember bench placement`: the ILP against the greedy baseline on a 70B-shaped problem, or
with `--shape` a forecast of Ember's whole-model plan against llama.cpp's whole-layer offload
on a named card (offload/hybrid/forecast.py).

The problem is synthetic but sized like Llama-2/3 70B: 80 FFN layers of 28,672 neurons at
hidden 8192, GQA attention with 8 KV heads of 128. Per layer, neuron frequencies follow a power
law whose steepness varies with depth (as profiles of ReLU models show: some layers
concentrate their activity in few neurons, others spread it), shuffled so that hot neurons are
not a prefix. Bytes per hot neuron are the gate and up rows plus the down column at the chosen
weight type; the FFN budget is the GPU memory minus attention weights, the LM head, a 4k-token
fp16 KV cache and a reserve. Costs are bandwidth-derived constants: a desktop GPU (~900 GB/s)
reading every hot neuron, DRAM (~30 GB/s effective for row gathers) reading active cold ones.
Both solvers are scored on the same cost model (`ember.placement.evaluate`).
"""

from __future__ import annotations

import time

from ember.models.support.errors import ConfigError

from .common import print_json

LAYERS, FFN, HIDDEN, KV_DIM, VOCAB, CTX = 80, 28672, 8192, 1024, 128256, 4096
BYTES_PER_WEIGHT = {"int8": 1.0, "fp16": 2.0}
GPU_BYTES_PER_MS = 900e9 / 1e3
CPU_BYTES_PER_MS = 30e9 / 1e3
RESERVE_GIB = 1.0


def _neuron_bytes(dtype: str) -> float:
    """Gate row + up row + down column; int8 adds one fp32 scale per row/column."""
    scales = 3 * 4 if dtype == "int8" else 0
    return 3 * HIDDEN * BYTES_PER_WEIGHT[dtype] + scales


def _budget_bytes(dtype: str, gpu_gib: float) -> tuple[float, dict]:
    w = BYTES_PER_WEIGHT[dtype]
    parts = {
        "attention": LAYERS * HIDDEN * (2 * HIDDEN + 2 * KV_DIM) * w,
        "lm_head": VOCAB * HIDDEN * w,
        "kv_cache": LAYERS * 2 * KV_DIM * 2 * CTX,
        "reserve": RESERVE_GIB * 2**30,
    }
    budget = gpu_gib * 2**30 - sum(parts.values())
    return max(budget, 0.0), {k: round(v / 2**30, 3) for k, v in parts.items()}


def _freqs(seed: int):
    """Per layer (FFN,) activation probabilities: power law, steepness varying with depth."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for layer in range(LAYERS):
        depth = layer / (LAYERS - 1)
        alpha = 0.55 + 0.6 * abs(np.sin(3.0 * depth)) + rng.uniform(-0.05, 0.05)
        knee = rng.uniform(50, 500)
        ranked = 0.95 * ((np.arange(FFN) + knee) / knee) ** -alpha
        ranked *= rng.uniform(0.9, 1.1, FFN)  # profiling noise
        out.append(rng.permutation(np.clip(ranked, 0.0, 1.0)))
    return out


def build_problem(dtype: str = "int8", gpu_gib: float = 24.0, group_size: int | None = None,
                  seed: int = 0):
    """The 70B-shaped PlacementProblem and a description of how it was sized."""
    import numpy as np

    from ember.placement import PlacementProblem, default_group_size

    if group_size is None:
        group_size = default_group_size([FFN] * LAYERS)
    nb = _neuron_bytes(dtype)
    budget, parts = _budget_bytes(dtype, gpu_gib)
    rng = np.random.default_rng(seed + 1)
    # Measured-ish per-layer constants, +-10% across layers as timings are.
    gpu_ms = nb / GPU_BYTES_PER_MS * rng.uniform(0.9, 1.1, LAYERS)
    cpu_ms = nb / CPU_BYTES_PER_MS * rng.uniform(0.9, 1.1, LAYERS)
    problem = PlacementProblem(
        freqs=_freqs(seed), neuron_bytes=nb, gpu_ms_per_neuron=gpu_ms, cpu_ms_per_active=cpu_ms,
        budget_bytes=budget, gpu_base_ms=0.010, cpu_base_ms=0.005, split_ms=0.030,
        min_hot=512, group_size=group_size)
    info = {"layers": LAYERS, "ffn": FFN, "hidden": HIDDEN, "dtype": dtype, "gpu_gib": gpu_gib,
            "neuron_bytes": nb, "ffn_budget_gib": round(budget / 2**30, 3),
            "ffn_total_gib": round(LAYERS * FFN * nb / 2**30, 3), "gpu_reserved_gib": parts,
            "mean_activation": round(float(np.mean([f.mean() for f in problem.freqs])), 4)}
    return problem, info


def _brief(result) -> dict:
    """The summary without its 80-entry per-layer lists."""
    return {k: v for k, v in result.summary().items()
            if k not in ("hot_fraction_per_layer", "layer_ms")}


def run(args) -> int:
    if args.shape is not None:
        return _forecast(args)
    from ember.placement import solve

    if args.group_size is not None and args.group_size < 1:
        raise ConfigError("--group-size must be >= 1")
    if not args.time_limit > 0:
        raise ConfigError("--time-limit must be > 0 seconds")
    if not args.gpu_gib > 0:
        raise ConfigError("--gpu-gib must be > 0")
    t0 = time.perf_counter()
    problem, info = build_problem(args.dtype, args.gpu_gib, args.group_size, args.seed)
    build_s = time.perf_counter() - t0
    greedy = solve(problem, "greedy")
    ilp = solve(problem, "ilp", time_limit_s=args.time_limit, threads=args.threads)
    report = {
        "problem": {**info, "group_size": problem.group_size, "build_s": round(build_s, 3)},
        "ilp": _brief(ilp),
        "greedy": _brief(greedy),
        "ilp_solve_s": round(ilp.solve_s, 3),
        "greedy_solve_s": round(greedy.solve_s, 3),
        "greedy_over_ilp": round(greedy.objective_ms / ilp.objective_ms, 4)
        if ilp.objective_ms > 0 else None,
        "ilp_status": ilp.status,
    }
    print_json(report)
    return 0


def _forecast(args) -> int:
    """`--shape`: Ember's whole-model plan and llama.cpp's whole-layer offload side by side
    on one card (offload/hybrid/forecast.py)."""
    from ember.models.support.sizes import format_size, parse_size
    from ember.offload.hybrid.forecast import forecast
    from ember.offload.hybrid.gpu_cards import card

    if args.ctx < 1:
        raise ConfigError("--ctx must be at least 1")
    report = forecast(args.shape, args.quant, parse_size(args.gpu_budget, "--gpu-budget"),
                      args.ctx, args.seed, card(args.gpu) if args.gpu else None)
    if not args.json:
        e, w, c = report["ember_plan"], report["whole_layer_offload"], report["card"]
        print(f"{args.shape} {args.quant} at --gpu-budget {args.gpu_budget} on {c['name']} "
              f"({c['gbps']:.0f} GB/s, PCIe {c['pcie_gen']}.0 x{c['pcie_lanes']}; "
              f"host {report['assumptions']['host_gbps']:.1f} GB/s), predicted")
        modes = ", ".join(f"{n} {m}" for m, n in e["layer_modes"].items() if n)
        print(f"  Ember plan      {modes}, LM head on the "
              f"{'tier' if e['lm_head_on_gpu'] else 'host'} ({format_size(e['gpu_bytes'])}): "
              f"{e['ms_per_token']:.1f} ms/token dense (CUDA graph; "
              f"{report['ember_plan_eager_ms_per_token']:.1f} eager), "
              f"{report['ember_sparse_plan']['ms_per_token']:.1f} sparse")
        print(f"  whole layers    {w['gpu_layers']} layers on the GPU "
              f"({format_size(w['gpu_bytes'])}): {w['ms_per_token']:.1f} ms/token")
    print_json(report)
    return 0
