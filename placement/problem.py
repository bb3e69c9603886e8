"""The placement problem: which FFN neurons to keep on the GPU tier, per layer, under a byte budget.

Everything the solvers need, and nothing they do. Per layer l (n_l neurons):

- `freqs[l]`, shape (n_l,): probability that a neuron is active for a token (from profiling).
- `neuron_bytes[l]`: GPU bytes of one hot neuron (its gate/up rows and its down column).
- `gpu_ms_per_neuron[l]`: GPU time per hot neuron; the GPU side computes every hot neuron.
- `cpu_ms_per_active[l]`: CPU time per *active* cold neuron; the CPU side computes only the
  predicted-active cold neurons, so its expected cost is that times the cold frequency mass.
- `gpu_base_ms[l]`, `cpu_base_ms[l]`: fixed cost of a side that has any neuron at all.
- `split_ms[l]`: what a split layer (some hot, some cold) pays to sync and move activations.
- `min_hot[l]`: a layer has 0 hot neurons or at least this many (smaller splits do not pay).

`budget_bytes` is what the runtime leaves for FFN neurons after attention, KV cache and so on.
Neurons are ranked hottest first within a layer and cut into groups of `group_size`; a solver
chooses how many leading groups of each layer are hot. For a given hot count the hottest
neurons are always the best choice (same bytes, same GPU cost, the most CPU work removed), so
nothing is lost by choosing prefixes, and groups only coarsen the count.

Scalars given for per-layer fields apply to every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ember.models.support.errors import ConfigError

_PER_LAYER = ("neuron_bytes", "gpu_ms_per_neuron", "cpu_ms_per_active",
              "gpu_base_ms", "cpu_base_ms", "split_ms")


@dataclass(frozen=True)
class LayerGroups:
    """One layer cut into groups, hottest first. K = number of groups.

    hot_counts[k]: hot neurons when the first k groups are hot, shape (K+1,).
    cold_mass[k]: expected active cold neurons per token then (sum of cold freqs), shape (K+1,).
    """

    hot_counts: np.ndarray
    cold_mass: np.ndarray

    @property
    def n_groups(self) -> int:
        return len(self.hot_counts) - 1


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    freqs: tuple[np.ndarray, ...]
    neuron_bytes: tuple[float, ...]
    gpu_ms_per_neuron: tuple[float, ...]
    cpu_ms_per_active: tuple[float, ...]
    budget_bytes: float
    gpu_base_ms: tuple[float, ...] | float = 0.0
    cpu_base_ms: tuple[float, ...] | float = 0.0
    split_ms: tuple[float, ...] | float = 0.0
    min_hot: tuple[int, ...] | int = 0
    group_size: int = 1
    _order: tuple[np.ndarray, ...] = field(init=False, repr=False, default=())
    _groups: tuple[LayerGroups, ...] = field(init=False, repr=False, default=())

    def __post_init__(self):
        freqs = self._check_freqs(self.freqs)
        self._set("freqs", freqs)
        for name in _PER_LAYER:
            self._set(name, _per_layer(name, getattr(self, name), len(freqs), integer=False))
        self._set("min_hot", _per_layer("min_hot", self.min_hot, len(freqs), integer=True))
        budget = _finite("budget_bytes", self.budget_bytes)
        if budget < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget:g} (the GPU has no room left "
                              "for FFN neurons once attention and the KV cache are placed; use 0)")
        self._set("budget_bytes", budget)
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, (int, np.integer, float)) \
                or not math.isfinite(gs) or gs != int(gs) or gs < 1:
            raise ConfigError(f"group_size must be a whole number >= 1, got {gs!r}")
        self._set("group_size", int(gs))
        for layer, (m, f) in enumerate(zip(self.min_hot, freqs)):
            if m > f.size:
                raise ConfigError(f"min_hot[{layer}] = {m} exceeds the layer's {f.size} neurons; "
                                  f"lower it to at most {f.size}")
        # Ranking, hottest first (stable: ties keep index order), and the group tables.
        order = tuple(np.argsort(-f, kind="stable").astype(np.int64) for f in freqs)
        self._set("_order", order)
        self._set("_groups", tuple(self._cut(f[o]) for f, o in zip(freqs, order)))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: normalized once, here

    @staticmethod
    def _check_freqs(freqs) -> tuple[np.ndarray, ...]:
        try:
            layers = [np.asarray(f, dtype=np.float64).reshape(-1) for f in freqs]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"freqs must be one sequence of numbers per layer ({exc})") from None
        if not layers:
            raise ConfigError("freqs is empty; give one array of neuron frequencies per layer")
        for layer, f in enumerate(layers):
            if f.size == 0:
                raise ConfigError(f"freqs[{layer}] is empty; every FFN layer has neurons")
            bad = ~np.isfinite(f) | (f < 0) | (f > 1)
            if bad.any():
                i = int(np.argmax(bad))
                raise ConfigError(f"freqs[{layer}] must hold probabilities in [0, 1]; neuron {i} "
                                  f"has {f[i]:g} (profile more tokens or clip the estimates)")
        return tuple(layers)

    def _cut(self, ranked: np.ndarray) -> LayerGroups:
        n, gs = ranked.size, self.group_size
        counts = np.minimum(np.arange(math.ceil(n / gs) + 1) * gs, n)
        mass = np.concatenate(([0.0], np.cumsum(ranked)))[counts]
        return LayerGroups(counts.astype(np.int64), np.maximum(mass[-1] - mass, 0.0))

    # -- queries --------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.freqs)

    @property
    def ffn_sizes(self) -> tuple[int, ...]:
        return tuple(int(f.size) for f in self.freqs)

    def order(self, layer: int) -> np.ndarray:
        """Neuron indices of `layer`, hottest first."""
        return self._order[layer]

    def groups(self, layer: int) -> LayerGroups:
        return self._groups[layer]

    def min_groups(self, layer: int) -> int:
        """Fewest groups whose neurons reach min_hot (0 when min_hot is 0)."""
        return int(np.searchsorted(self._groups[layer].hot_counts, self.min_hot[layer]))


def default_group_size(ffn_sizes, max_groups: int = 20_000) -> int:
    """A power-of-two group size giving at most about `max_groups` groups in all.

    The ILP's work grows with groups per layer; 20,000 keeps a 70B model (80 x 28,672 neurons,
    group size 128) near a second of CBC time on two cores, while small models get single neurons.
    """
    total = sum(int(n) for n in ffn_sizes)
    if max_groups < 1:
        raise ConfigError(f"max_groups must be >= 1, got {max_groups}")
    need = max(1, math.ceil(total / max_groups))
    return 1 << (need - 1).bit_length()


def _finite(name: str, value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return x


def _per_layer(name: str, value, n_layers: int, integer: bool) -> tuple:
    """A per-layer field as a tuple of n_layers non-negative numbers (a scalar is broadcast)."""
    values = np.asarray(value, dtype=object).reshape(-1) if np.ndim(value) else [value] * n_layers
    if len(values) != n_layers:
        raise ConfigError(f"{name} has {len(values)} values but there are {n_layers} layers; "
                          "give one per layer or a single number")
    out = []
    for layer, v in enumerate(values):
        x = _finite(f"{name}[{layer}]", v)
        if x < 0:
            raise ConfigError(f"{name}[{layer}] must be >= 0, got {x:g}")
        if integer and x != int(x):
            raise ConfigError(f"{name}[{layer}] must be a whole number of neurons, got {x:g}")
        out.append(int(x) if integer else x)
    return tuple(out)
