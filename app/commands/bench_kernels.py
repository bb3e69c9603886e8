"""`ember bench kernels`: sparse FFN vs our dense FFN, same run, batch-1 decode shapes.

What is compared, per shape x dtype x sparsity s (random sorted active sets of (1-s)*ffn):
- dense_ms, fp32: our dense PyTorch FFN as the model runs it (`x @ W_gate^T`, `x @ W_up^T`
  with pre-transposed weights, activation, `h @ W_down^T`; MKL underneath).
- dense_ms, int8: the C++ kernel with every neuron active. PyTorch has no fp32-activation int8
  FFN to compare with, so the dense side is the same code without an index list;
  `dense_torch_ms` reports `torch._weight_int8pack_mm` (one timing, for context).
- sparse_ms: `sparse_ffn` (C++ kernel) on the active set.
speedup = dense_ms / sparse_ms; ideal = 1 / (1 - s); fraction_of_ideal = speedup / ideal.
call_overhead_ms: `sparse_ffn` with an empty active set (Python, binding, output allocation).

Weights are random. ReLU-GLU gate rows are sign-flipped so every neuron fires for the bench
input: the kernel's skip of exact zeros never triggers (its worst case). Small shapes rotate
over enough layer copies (~256 MiB) that weights come from DRAM, as in real decoding.
"""

from __future__ import annotations

import math
import statistics
import time

from ember.models.support.errors import EmberError

from .common import print_json

SHAPES = (("llama-7b", 4096, 11008, "relu_glu"), ("gemma3-270m", 640, 2048, "gelu_glu"))
SPARSITIES = (0.0, 0.5, 0.8, 0.9)
ROTATE_BYTES = 256 << 20


def _layers(hidden: int, ffn: int, act: str, copies: int, seed: int):
    """[(fp32 SparseFFNWeights, (gate_t, up_t, down_nm) for the torch path)] * copies, and x."""
    import torch

    from ember.kernels.sparse_ffn import SparseFFNWeights

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=g)
    out = []
    for _ in range(copies):
        gate = torch.randn(ffn, hidden, generator=g) / math.sqrt(hidden)
        if act == "relu_glu":  # every neuron fires for x (see the module docstring)
            gate *= torch.where(gate @ x[0] < 0, -1.0, 1.0)[:, None]
        up = torch.randn(ffn, hidden, generator=g) / math.sqrt(hidden)
        down_nm = torch.randn(ffn, hidden, generator=g) / math.sqrt(ffn)
        w = SparseFFNWeights.from_rows(gate, up, down_nm, act, "fp32")  # copies into bundles
        out.append((w, (gate.t().contiguous(), up.t().contiguous(), down_nm)))
    return out, x


def _timed_ms(fn, n_calls: int) -> float:
    """Mean ms per call over n_calls calls (call i gets i: it picks the layer copy)."""
    t0 = time.perf_counter()
    for i in range(n_calls):
        fn(i)
    return (time.perf_counter() - t0) * 1e3 / n_calls


def _bench_dtype(layers, x, act, dtype, reps, gen):
    """Rows for one dtype. Dense and every sparsity are timed in turn within each repetition,
    so load from other processes hits all of them alike; medians over repetitions."""
    import torch

    from ember.kernels.sparse_ffn import SparseFFNWeights, sparse_ffn

    copies, ffn = len(layers), layers[0][0].ffn
    calls = max(copies, 8)
    if dtype == "int8":
        ws = [SparseFFNWeights.from_rows(w.gate, w.up, w.down_nm, act, "int8") for w, _ in layers]
    else:
        ws = [w for w, _ in layers]
    torch_dense = _torch_dense(layers, ws, x, act, dtype)
    empty = torch.empty(0, dtype=torch.long)
    # (run() checked the C++ kernels built: these time the kernel, never the reference)
    fns = {"dense_kernel": lambda i: sparse_ffn(x, ws[i % copies]),
           "empty": lambda i: sparse_ffn(x, ws[i % copies], empty)}
    if dtype == "fp32":
        fns["dense_torch"] = torch_dense
    for s in SPARSITIES:
        n = max(1, round((1 - s) * ffn))
        sets = [torch.randperm(ffn, generator=gen)[:n].sort().values for _ in range(calls)]
        fns[s] = lambda i, sets=sets: sparse_ffn(x, ws[i % copies], sets[i])
    for fn in fns.values():  # warm-up: first-touch page faults, lazy init
        fn(0)
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(reps):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:  # rotate: no fixed order bias
            times[k].append(_timed_ms(fns[k], calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    if dtype == "int8":  # ~10x slower than the kernel: context only, timed once
        torch_dense(0)
        med["dense_torch"] = _timed_ms(torch_dense, 2)
    return med, copies


def _bench_shape(name, hidden, ffn, act, reps, seed, dtypes):
    import torch

    copies = max(1, min(32, ROTATE_BYTES // (3 * hidden * ffn * 4)))
    layers, x = _layers(hidden, ffn, act, copies, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    for dtype in dtypes:
        med, copies = _bench_dtype(layers, x, act, dtype, reps, gen)
        dense_ms = med["dense_torch"] if dtype == "fp32" else med["dense_kernel"]
        for s in SPARSITIES:
            speedup, ideal = dense_ms / med[s], 1 / (1 - s)
            rows.append({
                "shape": f"{name} ({hidden}x{ffn}, {act})", "dtype": dtype, "sparsity": s,
                "dense_ms": round(dense_ms, 4), "sparse_ms": round(med[s], 4),
                "speedup": round(speedup, 3), "ideal": round(ideal, 3),
                "fraction_of_ideal": round(speedup / ideal, 3),
                "dense_torch_ms": round(med["dense_torch"], 4),
                "dense_kernel_ms": round(med["dense_kernel"], 4),
                "call_overhead_ms": round(med["empty"], 4),
                "weight_copies": copies,
            })
    return rows


def _torch_dense(layers, ws, x, act, dtype):
    """The PyTorch dense FFN for this dtype, as a function of the call number."""
    import torch

    from ember.models.transformer import activate

    n = len(layers)
    if dtype == "fp32":
        def run(i):
            gate_t, up_t, down_nm = layers[i % n][1]
            return activate(act, x @ gate_t, x @ up_t) @ down_nm
        return run
    # int8: (ffn, hidden) rows times x for gate/up; down needs (hidden, ffn) rows, so quantize
    # the down matrix by output row for this path.
    from ember.kernels.ffn_bundles import quantize_rows_int8

    downs = [quantize_rows_int8(layers[j][0].down_nm.t().contiguous()) for j in range(n)]
    # The int8 mm wants contiguous matrices; ours are views into the neuron bundles.
    mats = [tuple(t.contiguous() for t in (w.gate, w.gate_scale, w.up, w.up_scale)) for w in ws]

    def run(i):
        (gq, gs, uq, us), (dq, ds) = mats[i % n], downs[i % n]
        h = activate(act, torch._weight_int8pack_mm(x, gq, gs), torch._weight_int8pack_mm(x, uq, us))
        return torch._weight_int8pack_mm(h, dq, ds)
    return run


def run(args) -> int:
    import torch

    from ember.kernels import cpu_extension

    if args.threads is not None and args.threads < 1:
        raise EmberError("--threads must be >= 1")
    if args.reps < 1:
        raise EmberError("--reps must be >= 1")
    torch.set_num_threads(args.threads or 2)
    if cpu_extension.load() is None:
        raise EmberError(f"the C++ kernels could not be built ({cpu_extension.unavailable_reason()}); "
                         "install a C++ compiler and ninja")
    shapes = [s for s in SHAPES if args.shape in (None, s[0])]
    dtypes = (args.dtype,) if args.dtype else ("fp32", "int8")
    cases = []
    for i, (name, hidden, ffn, act) in enumerate(shapes):
        cases += _bench_shape(name, hidden, ffn, act, args.reps, 1234 + i, dtypes)
    report = {
        "threads": torch.get_num_threads(),
        "batch_tokens": 1,
        "reps": args.reps,
        "kernel_build": cpu_extension.build_flags()[0],
        "cases": cases,
    }
    print_json(report)
    return 0
