"""Measured per-neuron costs of each side, for the placement problem's latency model.

For one FFN layer of the model (its real weights), time:
- the CPU side (`sparse_ffn`) at two active-set sizes: the slope is ms per active neuron,
  the intercept the fixed cost of running the side at all;
- the GPU tier (`hot_ffn` on its device) at two hot-set sizes, likewise;
- the hand-off to the CPU worker and back (an empty job): what a split layer pays extra.
Medians of a few repetitions: these machines are noisy and the ILP only needs the shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from ember.kernels.hot_ffn import HotFFNWeights, hot_ffn
from ember.kernels.sparse_ffn import SparseFFNWeights, sparse_ffn
from ember.models.transformer import FeedForward

from .cpu_worker import CpuWorker
from .ffn import bundle_dtype
from .setup import resolve_cold_dtype
from .side_costs import SideCosts


def _median_ms(fn, reps: int) -> float:
    fn()  # warm up (first-touch pages, kernel build)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _line(n_lo: int, t_lo: float, n_hi: int, t_hi: float) -> tuple[float, float]:
    """(slope, intercept) through two timings, both clamped at >= 0."""
    slope = max(0.0, (t_hi - t_lo) / max(1, n_hi - n_lo))
    return slope, max(0.0, t_lo - slope * n_lo)


def measure_costs(ffn: FeedForward, gpu: torch.device, reps: int = 15,
                  cold_dtype: str = "auto") -> SideCosts:
    """Time one dense FFN layer's two sides (weights (in, out) on the host); the host side
    in the bundle type the runtime will use."""
    size = ffn.up.shape[1]
    lo, hi = max(1, size // 8), max(2, size // 2)
    rows = {
        "gate": None if ffn.gate is None else ffn.gate.t().contiguous(),
        "up": ffn.up.t().contiguous(),
        "down": ffn.down.contiguous(),
    }
    x = torch.randn(1, rows["up"].shape[1])
    # Bundles, as the layers predictors gate hold them (int8 for "file", whose ungated
    # layers the solver prices alike: an approximation on the cautious side, as the file's
    # blocks read fewer bytes).
    cold = SparseFFNWeights.from_rows(rows["gate"], rows["up"], rows["down"], ffn.activation,
                                      bundle_dtype(resolve_cold_dtype(cold_dtype)))
    t = {n: _median_ms(lambda n=n: sparse_ffn(x, cold, torch.arange(n)), reps) for n in (lo, hi)}
    cpu_slope, cpu_base = _line(lo, t[lo], hi, t[hi])

    def hot_of(n):
        g = None if rows["gate"] is None else rows["gate"][:n]
        return HotFFNWeights.from_rows(g, rows["up"][:n], rows["down"][:n], ffn.activation, gpu)

    x_gpu = x.to(gpu)
    g = {}
    for n in (lo, hi):
        w = hot_of(n)
        g[n] = _median_ms(lambda w=w: _sync(hot_ffn(x_gpu, w), gpu), reps)
    gpu_slope, gpu_base = _line(lo, g[lo], hi, g[hi])
    worker = CpuWorker()
    try:
        handoff = _median_ms(lambda: worker.submit(_noop, x).result(), reps)
    finally:
        worker.close()
    return SideCosts(cpu_slope, cpu_base, gpu_slope, gpu_base, handoff)


def _noop(x):
    return x


def _sync(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out
