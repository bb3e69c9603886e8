"""From a profile's statistics and measured costs to a placement for a given FFN room.

Builds `ember.placement`'s problem (per-neuron activity, bytes, the two sides' measured
costs) and solves it with the ILP. Layers without a predictor compute every cold neuron, so
their neurons count as always active on the CPU side.
"""

from __future__ import annotations

import numpy as np

from ember.placement.layout import Placement
from ember.placement.problem import PlacementProblem, default_group_size
from ember.placement.solve import solve

from .side_costs import SideCosts

DEFAULT_TIME_LIMIT_S = 5.0


def placement_problem(frequency, dense_layers: list[bool], neuron_bytes, costs: SideCosts,
                      room: int, min_hot: int | None = None) -> PlacementProblem:
    """Args:
        frequency: per layer (ffn,) activity in [0, 1] (tensors or arrays).
        dense_layers: per layer, True when no predictor gates the CPU side.
        neuron_bytes: per layer, GPU-tier bytes of one hot neuron.
        room: GPU-tier bytes left for FFN neurons.
        min_hot: smallest worthwhile hot set of a split layer (default: the neurons whose GPU
            time matches the hand-off cost, at least one group).
    """
    freqs = [np.ones(len(f)) if dense else np.clip(np.asarray(f, dtype=np.float64), 0, 1)
             for f, dense in zip(frequency, dense_layers)]
    group = default_group_size([f.size for f in freqs])
    if min_hot is None:
        per = max(costs.gpu_ms_per_neuron, 1e-9)
        min_hot = int(min(min(f.size for f in freqs), max(group, costs.split_ms / per)))
    return PlacementProblem(tuple(freqs), tuple(float(b) for b in neuron_bytes),
                            (costs.gpu_ms_per_neuron,) * len(freqs),
                            (costs.cpu_ms_per_active,) * len(freqs), max(0, room),
                            gpu_base_ms=costs.gpu_base_ms, cpu_base_ms=costs.cpu_base_ms,
                            split_ms=costs.split_ms, min_hot=min_hot, group_size=group)


def solve_for_room(problem: PlacementProblem, method: str = "ilp",
                   time_limit_s: float = DEFAULT_TIME_LIMIT_S):
    """The PlacementResult (`.placement`, `.objective_ms`, `.summary()`)."""
    return solve(problem, method, time_limit_s)


def chooser(frequency, dense_layers, neuron_bytes, costs: SideCosts):
    """(room, per-layer bytes of a hot neuron or None) -> Placement, for
    `plan_memory(choose=...)`, which passes the tier formats' bytes (None: `neuron_bytes`)."""
    def choose(room: int, per_neuron=None) -> Placement:
        problem = placement_problem(frequency, dense_layers,
                                    neuron_bytes if per_neuron is None else per_neuron,
                                    costs, room)
        return solve_for_room(problem).placement
    return choose
