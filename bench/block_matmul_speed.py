"""Quick speed probe of the block_matmul kernel: `python -m bench.block_matmul_speed`.

Decode (T=1): GB/s of weight bytes read, against a plain read of the same bytes timed
alternately (weights cycled through copies that together exceed the last-level cache, so
every call reads from memory). Prefill (T=128): GOPS = 2*N*K*T / time. And the old Q8_0 kernel
(q8_matmul.q8_0_matmul, int16 activations) against this one on the 262144 x 640 LM head.
Medians of several repeats: the machines here are shared, so repeat runs and compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels import q8_matmul
from ember.models import quants
from ember.models.quantize import quantize
from ember.models.weights import QTensor

DECODE_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (2048, 5632), (5632, 2048))
PREFILL_SHAPES = ((2048, 5632), (4096, 4096))
TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0")
STREAM_BYTES = 256 << 20  # > any last-level cache here


def weight(qtype: int, n: int, k: int) -> QTensor:
    """An (n, k) weight of realistic blocks: 64 quantized random rows, tiled (speed does not
    depend on the values, and quantizing 45M values in PyTorch takes a while)."""
    base = quantize(torch.randn(64, k) * 0.05, qtype).view(64, -1)
    rows = base.repeat((n + 63) // 64, 1)[:n].contiguous()
    return QTensor(rows.view(-1), qtype, (n, k))


def timed(fn, calls: int, repeats: int) -> float:
    """Median seconds per call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def read_bandwidth(repeats: int) -> tuple[float, float]:
    """(GB/s of a plain read: int64 sum of 256 MiB; GB/s of a 256 MiB copy, bytes read)."""
    src = torch.randint(0, 255, (STREAM_BYTES,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    words = src.view(torch.int64)
    read = timed(lambda: words.sum(), 3, repeats)
    copy = timed(lambda: dst.copy_(src), 3, repeats)
    return STREAM_BYTES / read / 1e9, STREAM_BYTES / copy / 1e9


def decode(types, shapes, repeats: int) -> None:
    """Each weight cycled through copies totalling 256 MiB; the plain read (int64 sum) of the
    same copies timed alternately with the kernel, so the ratio holds on a busy machine."""
    print("\nT=1 (decode): weight GB/s, and against a plain read of the same bytes (int64 sum)")
    for name in types:
        qtype = int(Q[name])
        for n, k in shapes:
            w = weight(qtype, n, k)
            copies = [w] + [QTensor(w.raw.clone(), qtype, w.shape)
                            for _ in range(max(1, STREAM_BYTES // w.nbytes) - 1)]
            words = [c.raw.view(torch.int64) for c in copies]
            x = torch.randn(1, k)

            def kernel():
                for c in copies:
                    bm.block_matmul(x, [c])

            def read():
                for v in words:
                    v.sum()

            kernel(), read()
            ks, rs = [], []
            for _ in range(repeats):
                ks.append(timed(kernel, 1, 1))
                rs.append(timed(read, 1, 1))
            s, r = statistics.median(ks) / len(copies), statistics.median(rs) / len(copies)
            gbs = w.nbytes / s / 1e9
            print(f"  {name:5s} {n:5d}x{k:<5d} {s * 1e3:7.3f} ms  {gbs:6.1f} GB/s  "
                  f"read {w.nbytes / r / 1e9:5.1f} GB/s  ratio {r / s:4.2f}")


def prefill(types, shapes, repeats: int, t: int = 128) -> None:
    print(f"\nT={t} (prefill): GOPS = 2*N*K*T / time")
    for name in types:
        qtype = int(Q[name])
        for n, k in shapes:
            w = weight(qtype, n, k)
            x = torch.randn(t, k)
            s = timed(lambda: bm.block_matmul(x, [w]), 2, repeats)
            print(f"  {name:5s} {n:5d}x{k:<5d} {s * 1e3:8.2f} ms  {2 * n * k * t / s / 1e9:6.1f} GOPS")


def lm_head(repeats: int) -> None:
    print("\nQ8_0 LM head 262144x640: old q8_0_matmul (int16 x) vs block_matmul (int8 x)")
    n, k = 262144, 640
    w = weight(int(Q.Q8_0), n, k)
    rows = q8_matmul.q8_0_rows(w.raw, n, k)
    for t in (1, 8):
        x = torch.randn(t, k)
        olds, news = [], []
        for _ in range(repeats):  # alternated, so that a busy spell hits both
            olds.append(timed(lambda: q8_matmul.q8_0_matmul(x, rows), 5, 1))
            news.append(timed(lambda: bm.block_matmul(x, [w]), 5, 1))
        old, new = statistics.median(olds), statistics.median(news)
        print(f"  T={t}: old {old * 1e3:6.2f} ms ({w.nbytes / old / 1e9:5.1f} GB/s)  "
              f"new {new * 1e3:6.2f} ms ({w.nbytes / new / 1e9:5.1f} GB/s)  new/old {new / old:4.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("decode", "prefill", "head"), default=None)
    ap.add_argument("--path", default=None, help="CPU path (default: the one chosen at load)")
    args = ap.parse_args()
    if not bm.available():
        raise SystemExit("the C++ kernels are unavailable here: nothing to measure")
    if args.path:
        bm.set_cpu_path(args.path)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    print(f"block_matmul, path {bm.cpu_path()}, {torch.get_num_threads()} threads")
    read_gbs, copy_gbs = read_bandwidth(args.repeats)
    print(f"256 MiB: plain read (int64 sum) {read_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s "
          f"(bytes read; {2 * copy_gbs:.1f} GB/s moved)")
    if args.only in (None, "decode"):
        decode(types, DECODE_SHAPES, args.repeats)
    if args.only in (None, "head"):
        lm_head(args.repeats)
    if args.only in (None, "prefill"):
        prefill(types, PREFILL_SHAPES, args.repeats)


if __name__ == "__main__":
    main()
