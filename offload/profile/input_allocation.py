"""Allocating input sparsity across the whole body by measured end-to-end cost.

The per-block greedy (input_calibration.allocate) ranks slots by the share of their matmul's
output energy the dropped inputs carry, and gives every block the same mean sparsity. On a
small model the blocks are far from equally tolerant (measured on the default model: one
slot alone at 50% costs from 0.0013 to 0.057 nats of KL depending on layer and slot), so a
uniform per-block target spends the budget where it is dearest.

Here each slot's proxy error curve e(s) (input_calibration.SlotStats.error) is turned into an
end-to-end cost by one measurement: the KL divergence from the dense model's next-token
distribution, on calibration text, with only that slot thresholded at a probe level. To second
order the KL is a quadratic form in the output perturbation, and e(s) is that perturbation's
energy, so cost(s) ~ gain * e(s) with gain = KL(probe) / e(probe). A global greedy then raises,
across every layer and slot, the one whose next step costs the least predicted KL per matmul
sparsity gained, until the body's mean over its matmuls reaches the target.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from ember.predictors.passes import LOGIT_ROWS, segments

from ..body.input_sparsity import MATMULS, SLOTS

PROBE = 0.5  # sparsity at which each slot's end-to-end cost is measured
KL_TOKENS = 256  # calibration tokens whose dense next-token distributions are kept


@dataclass
class DenseReference:
    """The dense model's log-probabilities over a few calibration segments (half precision:
    256 positions x 262k vocabulary is 134 MB)."""

    segments: list[torch.Tensor]
    logp: list[torch.Tensor]


@torch.inference_mode()
def _log_probs(model, seg: torch.Tensor, cache) -> torch.Tensor:
    cache.truncate(0)
    hidden = model.hidden(seg, cache)
    return torch.cat([torch.log_softmax(model.logits(hidden[c: c + LOGIT_ROWS]).float(), -1)
                      for c in range(0, hidden.shape[0], LOGIT_ROWS)])


def dense_reference(model, ids: list[int], bos: int | None, length: int) -> DenseReference:
    """Run the first KL_TOKENS calibration tokens densely (no thresholds must be applied)."""
    segs = segments(ids[:KL_TOKENS], length, bos)
    cache = model.new_cache(length)
    return DenseReference(segs, [_log_probs(model, s, cache).half() for s in segs])


def kl_from_dense(model, ref: DenseReference, length: int) -> float:
    """Mean KL(dense || model as now thresholded) per position, nats."""
    cache, total, n = model.new_cache(length), 0.0, 0
    for seg, dense in zip(ref.segments, ref.logp):
        now = _log_probs(model, seg, cache)
        d = dense.float()
        total += float((d.exp() * (d - now)).sum())
        n += d.shape[0]
    return max(0.0, total / max(1, n))


def slot_gains(stats, n_layers: int, measure: Callable[[int, str, float], float],
               probe: float = PROBE, log: Callable[[str], None] = lambda m: None
               ) -> dict[tuple[int, str], float]:
    """Per (layer, slot): measured KL at `probe` (only that slot thresholded) over the proxy
    error there. `measure(layer, slot, threshold)` returns the KL."""
    gains = {}
    for i in range(n_layers):
        for slot in SLOTS:
            st = stats[(i, slot)]
            kl = measure(i, slot, st.threshold(probe))
            gains[(i, slot)] = kl / max(st.error(probe), 1e-12)
        log(f"layer {i}: KL at {probe:.0%} " + ", ".join(
            f"{s} {gains[(i, s)] * stats[(i, s)].error(probe):.4f}" for s in SLOTS))
    return gains


def allocate_global(stats, gains: dict[tuple[int, str], float], n_layers: int,
                    target: float, levels: tuple[float, ...], step: float):
    """Global greedy over every (layer, slot): returns per-layer {slot: level}."""
    total = n_layers * sum(MATMULS.values())
    at = {key: 0 for key in gains}
    curve = {key: [stats[key].error(lv) for lv in levels] for key in gains}

    def price(key):  # predicted KL per unit of body-mean sparsity of the next step
        i = at[key]
        return gains[key] * (curve[key][i + 1] - curve[key][i]) / (MATMULS[key[1]] * step)

    heap = [(price(k), k) for k in gains if len(levels) > 1]
    heapq.heapify(heap)
    reached = 0.0
    while heap and reached < target * total - 1e-9:
        _, key = heapq.heappop(heap)
        at[key] += 1
        reached += MATMULS[key[1]] * step
        if at[key] + 1 < len(levels):
            heapq.heappush(heap, (price(key), key))
    return [{s: levels[at[(i, s)]] for s in SLOTS} for i in range(n_layers)]
