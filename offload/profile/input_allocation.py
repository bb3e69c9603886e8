"""Allocating input sparsity across the whole body by measured end-to-end cost.

The per-block greedy (input_calibration.allocate) ranks slots by the share of their matmul's
output energy the dropped inputs carry, and gives every block the same mean sparsity. On a
small model the blocks are far from equally tolerant (measured on the default model: one
slot alone at 50% costs from 0.0013 to 0.057 nats of KL depending on layer and slot), so a
uniform per-block target spends the budget where it is dearest.

Here each slot's proxy error curve e(s) (input_calibration.SlotStats.error) is turned into an
end-to-end cost by measurement: the KL divergence from the dense model's next-token
distribution, on calibration text, with only that slot thresholded at a few probe levels. To
second order the KL is a quadratic form in the output perturbation, and e(s) is that
perturbation's energy, so cost(s) ~ gain * e(s) with gain = KL(probe) / e(probe). With
several probes the gain is measured at each and interpolated between them (the gain of
gate/up and q/k/v grows with the level, so one probe at 50% may misjudge the low levels a
tight budget lives at). A global greedy then raises, across every layer and slot, the one
whose next step costs the least predicted KL per matmul sparsity gained, until the body's
mean over its matmuls reaches the target.

The KL each drop adds, not the KL itself: the dense kernels round x to int8 per block, so a
pass is chaotic: any change upstream, even 1e-7 relative, flips roundings downstream and moves
the last hidden state by ~3.5% (float x: 7e-5). Measured on the default model, one slot on
the input-major kernels with threshold 0 (nothing dropped; the matmul equal to 2e-7) already
costs 0.006-0.009 nats in layer 0 and ~0.0027 in layer 9, about what dropping half of o or
down costs; every slot at threshold 0 together costs 0.0107 (the noise does not add up). So
each slot's floor, its KL at threshold 0, is measured too and subtracted from its probes:
ranked by absolute KL, every slot would look as dear as its floor and the cheap ones would be
hidden behind it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from ember.predictors.passes import LOGIT_ROWS, segments

from ..body.input_sparsity import MATMULS, SLOTS

PROBES = (0.5,)  # sparsities at which each slot's end-to-end cost is measured (and 0: its floor)
# Calibration tokens whose dense next-token distributions are kept: one pass segment of 512
# (half precision, 268 MB), so that the KL a drop adds stands clear of the noise.
KL_TOKENS = 511


@dataclass
class DenseReference:
    """The dense model's log-probabilities over a few calibration segments (half precision:
    511 positions x 262k vocabulary is 268 MB)."""

    segments: list[torch.Tensor]
    logp: list[torch.Tensor]


@torch.inference_mode()
def _log_probs(model, seg: torch.Tensor, cache) -> torch.Tensor:
    cache.truncate(0)
    hidden = model.hidden(seg, cache)
    return torch.cat([torch.log_softmax(model.logits(hidden[c: c + LOGIT_ROWS]).float(), -1)
                      for c in range(0, hidden.shape[0], LOGIT_ROWS)])


def dense_reference(model, ids: list[int], bos: int | None, length: int,
                    tokens: int = KL_TOKENS) -> DenseReference:
    """Run the first `tokens` calibration tokens densely (no thresholds must be applied)."""
    segs = segments(ids[:tokens], length, bos)
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


def slot_costs(stats, n_layers: int, measure: Callable[[int, str, float], float],
               levels: tuple[float, ...], probes: tuple[float, ...] = PROBES,
               log: Callable[[str], None] = lambda m: None) -> dict[tuple[int, str], list[float]]:
    """Per (layer, slot): predicted KL at each of `levels`, from the KL measured at `probes`
    with only that slot thresholded (`measure(layer, slot, threshold)` returns it), less the
    slot's floor (its KL at threshold 0, nothing dropped)."""
    costs = {}
    for i in range(n_layers):
        measured = {}
        for slot in SLOTS:
            st = stats[(i, slot)]
            measured[slot] = [measure(i, slot, 0.0)] + [measure(i, slot, st.threshold(p))
                                                        for p in probes]
            floor = measured[slot][0]
            added = [(p, max(0.0, kl - floor)) for p, kl in zip(probes, measured[slot][1:])]
            costs[(i, slot)] = cost_curve(st, added, levels)
        log(f"layer {i}: KL at 0/" + "/".join(f"{p:.0%}" for p in probes) + " " + ", ".join(
            f"{s} " + "/".join(f"{kl:.4f}" for kl in measured[s]) for s in SLOTS))
    return costs


def cost_curve(st, probed: list[tuple[float, float]], levels: tuple[float, ...]) -> list[float]:
    """Predicted KL at each level: the proxy error there times the gain (measured KL over
    proxy error) interpolated linearly in the level between the probes, held beyond them;
    kept non-decreasing."""
    xs = [p for p, _ in probed]
    gains = [kl / max(st.error(p), 1e-12) for p, kl in probed]
    out, top = [], 0.0
    for lv in levels:
        top = max(top, _interp(lv, xs, gains) * st.error(lv))
        out.append(top)
    return out


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def allocate_global(costs: dict[tuple[int, str], list[float]], n_layers: int, target: float,
                    levels: tuple[float, ...], step: float):
    """Global greedy over every (layer, slot), `costs[key][k]` its predicted KL at
    levels[k]: returns per-layer {slot: level}."""
    total = n_layers * sum(MATMULS.values())
    at = {key: 0 for key in costs}

    def price(key):  # predicted KL per unit of body-mean sparsity of the next step
        i = at[key]
        return (costs[key][i + 1] - costs[key][i]) / (MATMULS[key[1]] * step)

    heap = [(price(k), k) for k in costs if len(levels) > 1]
    heapq.heapify(heap)
    reached = 0.0
    while heap and reached < target * total - 1e-9:
        _, key = heapq.heappop(heap)
        at[key] += 1
        reached += MATMULS[key[1]] * step
        if at[key] + 1 < len(levels):
            heapq.heappush(heap, (price(key), key))
    return [{s: levels[at[(i, s)]] for s in SLOTS} for i in range(n_layers)]
