"""Speed probe of the input-sparse kernel: `python -m bench.input_sparse_speed`.

Decode (T=1): the dense block_matmul on the file's blocks against input_sparse_matmul on the
same weight's input-major layout, at several input sparsities, timed alternately (weights cycled
through copies that together exceed the last-level cache, so every call reads from memory).
Each line gives the time, the speedup over dense and the ideal speedup from the bytes read
(file bytes / (the tiles' headers + the kept inputs' runs)). Prefill (T=64): GOPS of both. Medians of several
repeats: the machines here are shared, so compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels import input_sparse as isp
from ember.kernels import tile_layout as tl
from ember.models.weights import QTensor

from .block_matmul_speed import STREAM_BYTES, timed, weight

SHAPES = ((5632, 2048), (2048, 5632), (11008, 4096), (4096, 11008), (2048, 640), (640, 2048))
TYPES = ("Q4_K", "Q6_K", "Q8_0")
SPARSITIES = (0.0, 0.4, 0.5, 0.7)


def threshold_for(x: torch.Tensor, sparsity: float) -> float | None:
    """The |x| quantile that drops `sparsity` of x's inputs (None: keep all)."""
    if sparsity <= 0:
        return None
    return float(x.abs().flatten().kthvalue(max(1, int(sparsity * x.numel()))).values)


def decode(name: str, n: int, k: int, repeats: int) -> None:
    qtype = int(Q[name])
    w = weight(qtype, n, k)
    im = isp.relayout(w)
    count = max(1, STREAM_BYTES // w.nbytes)
    files = [w] + [QTensor(w.raw.clone(), qtype, w.shape) for _ in range(count - 1)]
    ims = [im] + [isp.InputMajor(im.packed.clone(), im.qtype, im.shape) for _ in range(count - 1)]
    x = torch.randn(1, k)

    def dense():
        for c in files:
            bm.block_matmul(x, [c])

    def sparse(thr):
        def run():
            for c in ims:
                isp.input_sparse_matmul(x, [c], thr)
        return run

    runs = {"dense": dense} | {s: sparse(threshold_for(x, s)) for s in SPARSITIES}
    times: dict = {key: [] for key in runs}
    for fn in runs.values():
        fn()
    for _ in range(repeats):  # alternated, so a busy spell hits every variant
        for key, fn in runs.items():
            times[key].append(timed(fn, 1, 1) / count)
    d = statistics.median(times["dense"])
    print(f"  {name} {n}x{k} -> {isp.quants.type_name(im.qtype)}  dense {d * 1e3:6.3f} ms "
          f"({w.nbytes / d / 1e9:4.1f} GB/s)  tiles {im.nbytes / w.nbytes:4.2f}x bytes")
    for s in SPARSITIES:
        t = statistics.median(times[s])
        header, run = tl.header_and_run_bytes(qtype, n, k)
        ideal = w.nbytes / (header + run * round(k * (1 - s)))
        print(f"    sparsity {s:3.0%}: {t * 1e3:6.3f} ms  speedup {d / t:4.2f}  ideal "
              f"{ideal:4.2f}  ({d / t / ideal:4.2f} of ideal)")


def prefill(name: str, n: int, k: int, repeats: int, t: int = 64) -> None:
    qtype = int(Q[name])
    w = weight(qtype, n, k)
    im = isp.relayout(w)
    x = torch.randn(t, k)
    ds, ss = [], []
    for _ in range(repeats):
        ds.append(timed(lambda: bm.block_matmul(x, [w]), 2, 1))
        ss.append(timed(lambda: isp.input_sparse_matmul(x, [im]), 2, 1))
    d, s = statistics.median(ds), statistics.median(ss)
    ops = 2 * n * k * t / 1e9
    print(f"  {name} {n}x{k} T={t}: block_matmul {ops / d:5.1f} GOPS, input-major "
          f"{ops / s:5.1f} GOPS ({d / s:4.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    p.add_argument("--no-prefill", action="store_true")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    print(f"path {bm.cpu_path()}, {torch.get_num_threads()} threads")
    print("T=1 (decode): dense block_matmul vs input-sparse, alternated")
    for name in a.types.split(","):
        for n, k in shapes:
            decode(name, n, k, a.repeats)
    if not a.no_prefill:
        print("prefill")
        for name in a.types.split(","):
            for n, k in shapes[:2]:
                prefill(name, n, k, a.repeats)


if __name__ == "__main__":
    main()
