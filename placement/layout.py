"""A placement: for every FFN layer, which neurons are hot (kept on the GPU tier).

It is the contract between the solver (this package, numpy only) and the runtime
(`ember.offload.hybrid.ffn`), and it is what a profile artifact stores. Neuron indices are
sorted, unique and in range; everything else about a neuron (its rows, its cost) is derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    ffn_sizes: tuple[int, ...]  # neurons per layer
    hot: tuple[np.ndarray, ...]  # per layer: sorted unique int64 indices of GPU-tier neurons

    def __post_init__(self):
        if len(self.hot) != len(self.ffn_sizes):
            raise ValueError(f"placement has {len(self.hot)} layers of hot neurons but "
                             f"{len(self.ffn_sizes)} layer sizes")
        fixed = []
        for layer, (idx, size) in enumerate(zip(self.hot, self.ffn_sizes)):
            idx = np.asarray(idx, dtype=np.int64).reshape(-1)
            if idx.size and (idx.min() < 0 or idx.max() >= size):
                raise ValueError(f"layer {layer}: hot neuron index outside 0..{size - 1}")
            if idx.size > 1 and not np.all(np.diff(idx) > 0):
                idx = np.unique(idx)
            fixed.append(idx)
        object.__setattr__(self, "hot", tuple(fixed))

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def uniform(cls, ffn_sizes, fraction: float) -> "Placement":
        """The first `fraction` of each layer's neurons hot (no statistics: any split is as good)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"hot fraction must be in [0, 1], got {fraction}")
        sizes = tuple(int(s) for s in ffn_sizes)
        return cls(sizes, tuple(np.arange(int(round(fraction * s)), dtype=np.int64) for s in sizes))

    @classmethod
    def from_counts(cls, ffn_sizes, counts, order=None) -> "Placement":
        """`counts[l]` hottest neurons of layer l hot; `order[l]` lists neurons hottest first
        (default: index order)."""
        sizes = tuple(int(s) for s in ffn_sizes)
        hot = []
        for layer, (n, size) in enumerate(zip(counts, sizes)):
            if not 0 <= int(n) <= size:
                raise ValueError(f"layer {layer}: {n} hot neurons but the layer has {size}")
            ranked = np.arange(size) if order is None else np.asarray(order[layer])
            hot.append(np.sort(ranked[: int(n)]).astype(np.int64))
        return cls(sizes, tuple(hot))

    # -- queries --------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.ffn_sizes)

    def hot_count(self, layer: int) -> int:
        return int(self.hot[layer].size)

    def hot_fraction(self, layer: int) -> float:
        size = self.ffn_sizes[layer]
        return self.hot_count(layer) / size if size else 0.0

    def cold(self, layer: int) -> np.ndarray:
        """Sorted indices of the layer's cold (host) neurons."""
        mask = np.ones(self.ffn_sizes[layer], dtype=bool)
        mask[self.hot[layer]] = False
        return np.flatnonzero(mask).astype(np.int64)

    def total_hot_fraction(self) -> float:
        total = sum(self.ffn_sizes)
        return sum(self.hot_count(i) for i in range(self.n_layers)) / total if total else 0.0

    def summary(self) -> dict:
        return {"hot_fraction": round(self.total_hot_fraction(), 4),
                "hot_fraction_per_layer": [round(self.hot_fraction(i), 4)
                                           for i in range(self.n_layers)]}
