"""The baseline: hottest neurons per byte first, across all layers, until the budget is full.

This is what a plain top-K placement does: it never looks at the CPU/GPU balance of a layer or
at the split overhead. Layers that end below their minimum hot count are made all-cold and the
bytes they free go to the next hottest groups elsewhere. It works on the same groups as the ILP
so the two are compared on the same choices.
"""

from __future__ import annotations

import time

import numpy as np

from .cost_model import PlacementResult, result_from_groups
from .problem import PlacementProblem


def greedy_groups(problem: PlacementProblem) -> list[int]:
    """Groups hot per layer (a prefix of each layer's ranking)."""
    layer_of, k_of, density, nbytes = _group_table(problem)
    # Hottest per byte first; ties by layer then group, which keeps each layer a prefix
    # (a group's mean frequency never exceeds the one before it in the same layer).
    rank = np.lexsort((k_of, layer_of, -density))
    layer_of, k_of, nbytes = layer_of[rank], k_of[rank], nbytes[rank]
    banned = np.zeros(problem.n_layers, dtype=bool)
    min_groups = np.array([problem.min_groups(l) for l in range(problem.n_layers)])
    while True:
        keep = ~banned[layer_of]
        taken = np.cumsum(np.where(keep, nbytes, 0.0)) <= problem.budget_bytes
        taken &= keep
        counts = np.bincount(layer_of[taken], minlength=problem.n_layers)
        short = (counts > 0) & (counts < min_groups)
        if not short.any():
            return [int(c) for c in counts]
        banned |= short


def _group_table(problem: PlacementProblem):
    """Flat arrays over every (layer, group): layer, group index, freq mass per byte, bytes."""
    layers, ks, dens, nbytes = [], [], [], []
    for l in range(problem.n_layers):
        g = problem.groups(l)
        size = np.diff(g.hot_counts).astype(np.float64)
        mass = -np.diff(g.cold_mass)
        b = size * problem.neuron_bytes[l]
        layers.append(np.full(size.size, l))
        ks.append(np.arange(size.size))
        dens.append(mass / np.maximum(b, 1e-300))
        nbytes.append(b)
    return (np.concatenate(layers), np.concatenate(ks), np.concatenate(dens),
            np.concatenate(nbytes))


def solve_greedy(problem: PlacementProblem) -> PlacementResult:
    t0 = time.perf_counter()
    groups = greedy_groups(problem)
    return result_from_groups(problem, groups, "greedy", "heuristic", time.perf_counter() - t0)
