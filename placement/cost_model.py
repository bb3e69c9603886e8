"""The expected per-token latency of a placement, and the result every solver returns.

Per layer, with h hot neurons of n and cold frequency mass F (expected active cold neurons):

    gpu = gpu_base + gpu_ms_per_neuron * h        if h > 0 else 0
    cpu = cpu_base + cpu_ms_per_active * F        if h < n else 0
    latency = max(gpu, cpu) + split_ms * [0 < h < n]

The two sides run concurrently, hence the max; the total is the sum over layers. Solvers and
baselines are compared on this one model (`evaluate`), never on their own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.models.support.errors import ConfigError

from .layout import Placement
from .problem import PlacementProblem


def latency_ms(problem: PlacementProblem, layer: int, hot, cold_mass) -> np.ndarray:
    """Latency of `layer` for hot counts `hot` with cold masses `cold_mass` (same shape)."""
    hot = np.asarray(hot, dtype=np.float64)
    n = problem.freqs[layer].size
    gpu = np.where(hot > 0, problem.gpu_base_ms[layer] + problem.gpu_ms_per_neuron[layer] * hot, 0.0)
    cpu = np.where(hot < n, problem.cpu_base_ms[layer]
                   + problem.cpu_ms_per_active[layer] * np.asarray(cold_mass), 0.0)
    split = np.where((hot > 0) & (hot < n), problem.split_ms[layer], 0.0)
    return np.maximum(gpu, cpu) + split


def layer_curve(problem: PlacementProblem, layer: int) -> np.ndarray:
    """Latency of `layer` when its first k groups are hot, for k = 0..K; shape (K+1,)."""
    g = problem.groups(layer)
    return latency_ms(problem, layer, g.hot_counts, g.cold_mass)


@dataclass(frozen=True)
class Evaluation:
    total_ms: float  # expected FFN latency per token, summed over layers
    layer_ms: tuple[float, ...]
    hot_bytes: float
    within_budget: bool
    min_hot_ok: bool  # every layer has 0 hot neurons or at least min_hot

    @property
    def feasible(self) -> bool:
        return self.within_budget and self.min_hot_ok


def evaluate(problem: PlacementProblem, placement: Placement) -> Evaluation:
    """The cost-model latency of any placement (neuron level: groups play no part here)."""
    if tuple(placement.ffn_sizes) != problem.ffn_sizes:
        raise ConfigError(f"placement layer sizes {placement.ffn_sizes[:4]}… do not match the "
                         f"problem's {problem.ffn_sizes[:4]}…")
    layer_ms, hot_bytes, min_ok = [], 0.0, True
    for layer, f in enumerate(problem.freqs):
        idx = placement.hot[layer]
        h = idx.size
        cold_mass = max(float(f.sum() - f[idx].sum()), 0.0)
        layer_ms.append(float(latency_ms(problem, layer, h, cold_mass)))
        hot_bytes += h * problem.neuron_bytes[layer]
        min_ok &= h == 0 or h >= problem.min_hot[layer]
    # A relative tolerance: byte counts are sums of floats.
    within = hot_bytes <= problem.budget_bytes * (1 + 1e-12) + 1e-9
    return Evaluation(float(sum(layer_ms)), tuple(layer_ms), hot_bytes, bool(within), bool(min_ok))


@dataclass(frozen=True)
class PlacementResult:
    """A solver's answer: the placement and its cost-model evaluation."""

    placement: Placement
    evaluation: Evaluation
    method: str  # "ilp" or "greedy"
    status: str  # "optimal", "time_limit" (best incumbent), "fallback" (ILP found nothing better)
    solve_s: float  # wall time, model building included
    group_size: int

    @property
    def objective_ms(self) -> float:
        return self.evaluation.total_ms

    @property
    def layer_ms(self) -> tuple[float, ...]:
        return self.evaluation.layer_ms

    def summary(self) -> dict:
        ev = self.evaluation
        return {"method": self.method, "status": self.status,
                "objective_ms": round(ev.total_ms, 6), "solve_s": round(self.solve_s, 3),
                "group_size": self.group_size, "hot_bytes": int(round(ev.hot_bytes)),
                "feasible": ev.feasible, **self.placement.summary(),
                "layer_ms": [round(x, 6) for x in ev.layer_ms]}


def result_from_groups(problem: PlacementProblem, groups_hot, method: str, status: str,
                       solve_s: float) -> PlacementResult:
    """Build the result for 'the first groups_hot[l] groups of layer l are hot'."""
    counts = [int(problem.groups(l).hot_counts[k]) for l, k in enumerate(groups_hot)]
    orders = [problem.order(l) for l in range(problem.n_layers)]
    placement = Placement.from_counts(problem.ffn_sizes, counts, orders)
    return PlacementResult(placement, evaluate(problem, placement), method, status, solve_s,
                           problem.group_size)
