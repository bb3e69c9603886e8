"""Measured per-neuron costs of each side of a split FFN layer (what `ember profile` times
with cost_probe.measure_costs and stores in its artifact), as the placement solver prices
them. A module of its own: the solver (placement_solver.py), the split's setup (setup.py)
and the probe all read it, and none of them needs the others for it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SideCosts:
    cpu_ms_per_active: float
    cpu_base_ms: float
    gpu_ms_per_neuron: float
    gpu_base_ms: float
    split_ms: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SideCosts":
        values = {k: float(d[k]) for k in cls.__dataclass_fields__}
        if any(not (v >= 0) or v == float("inf") for v in values.values()):
            raise ValueError("costs must be finite and non-negative")
        return cls(**values)
