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
costs 0.0034-0.0061 nats, about what dropping half of o or down costs; every slot of every
layer at threshold 0 together costs 0.0107 (the noise does not add up). So each probed
layer's floor, its KL with its four slots at threshold 0, is measured too and subtracted from
its probes: ranked by absolute KL, every slot would look as dear as its floor and the cheap
ones would be hidden behind it. One floor per layer, not per slot: a slot's floor and its
probe flip different roundings, so a per-slot floor only estimates the same noise level again
(the four single-slot floors of a layer agree within 0.0015 nats).

What a probe costs (the stage was ~80% of `ember profile`'s time, ~2 min a layer on a 1.5B):
- It re-runs only the layers from the probed one (layer_chain.py: the dense pass keeps what
  entered each layer), half the body on average, with the same bits as a whole pass.
- Its KL is over a shortlist of the vocabulary, the union of each position's SHORTLIST
  likeliest dense tokens (5,177 of the default model's 262,144 on its calibration segment),
  renormalized: the full LM head over 511 positions cost 2.3x the body on the default model.
  It reads a few percent below the full KL (the tail it leaves out), about uniformly.
- Each slot is probed once, at 50%. Probing only every `every`-th layer (the layers between
  taking their neighbours' gains, interpolated in depth) is there for larger models, but on
  the default model every second layer halved the sparsity reached (PROBE_EVERY).
What each of these costs in the thresholds' quality is measured in docs/profiling.md.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from ember.predictors.passes import LOGIT_ROWS, segments

from ..body.input_sparsity import MATMULS, SLOTS

PROBES = (0.5,)  # sparsities at which each slot's end-to-end cost is measured (and 0: its floor)
# Probe every layer. Every second one (the layers between taking their neighbours' gains,
# interpolated) halves the stage but, on the default model, also halved the sparsity reached
# within the budget (9.1% against 19.1% realized, docs/profiling.md).
PROBE_EVERY = 1
# Calibration tokens whose dense next-token distributions are kept: one pass segment of 512,
# so that the KL a drop adds stands clear of the noise.
KL_TOKENS = 511
# Each position's likeliest dense tokens: the KL is taken over their union (a few thousand
# of the default model's 262k), so a probe's LM head costs that many rows, not the vocabulary.
SHORTLIST = 64


@dataclass
class DenseReference:
    """The dense pass over a few calibration segments: what entered each layer (a probe of
    layer i re-runs layers i.. from there: layer_chain.py) and the log-probabilities over the
    shortlist (`rows`: the LM head's rows of every position's SHORTLIST likeliest tokens)."""

    segments: list[torch.Tensor]
    inputs: list[list[torch.Tensor]]  # per segment, per layer: (T, hidden)
    rows: object  # QTensor: the head's rows of the shortlist
    logp: list[torch.Tensor]  # per segment: (T, shortlist) log-probabilities over it


def _shortlist_logp(model, hidden: torch.Tensor, rows) -> torch.Tensor:
    return torch.log_softmax(model.head.scores(hidden, rows).float(), -1)


@torch.inference_mode()
def dense_reference(chain, ids: list[int], bos: int | None, length: int,
                    tokens: int = KL_TOKENS, shortlist: int = SHORTLIST) -> DenseReference:
    """Run the first `tokens` calibration tokens densely through `chain` (a LayerChain)."""
    model = chain.model
    segs = segments(ids[:tokens], length, bos)
    cache = model.new_cache(length)
    inputs, hiddens = [], []
    for seg in segs:
        xs = chain.dense_inputs(seg, cache)
        inputs.append(xs[:-1])
        hiddens.append(chain.final(xs[-1]))
    top = [model.logits(h[c: c + LOGIT_ROWS]).topk(shortlist, dim=-1).indices.flatten()
           for h in hiddens for c in range(0, h.shape[0], LOGIT_ROWS)]
    rows = model.head.stored.select_rows(torch.cat(top).unique())
    return DenseReference(segs, inputs, rows, [_shortlist_logp(model, h, rows) for h in hiddens])


@torch.inference_mode()
def kl_from_layer(chain, ref: DenseReference, first: int) -> float:
    """Mean KL(dense || now) per position over the shortlist, nats, of a pass whose layers
    first.. run as `chain`'s steps are now thresholded (the ones before ran densely)."""
    cache = chain.model.new_cache(max(len(s) for s in ref.segments))
    total, n = 0.0, 0
    for xs, dense in zip(ref.inputs, ref.logp):
        now = _shortlist_logp(chain.model, chain.hidden_from(first, xs[first], cache), ref.rows)
        total += float((dense.exp() * (dense - now)).sum())
        n += dense.shape[0]
    return max(0.0, total / max(1, n))


def probed_layers(n_layers: int, every: int = PROBE_EVERY) -> list[int]:
    """The layers whose slots are probed: every `every`-th from the first, and the last."""
    return sorted(set(range(0, n_layers, every)) | {n_layers - 1})


def slot_costs(stats, n_layers: int, measure: Callable[[int, dict[str, float]], float],
               levels: tuple[float, ...], probes: tuple[float, ...] = PROBES,
               every: int = PROBE_EVERY, log: Callable[[str], None] = lambda m: None
               ) -> dict[tuple[int, str], list[float]]:
    """Per (layer, slot): predicted KL at each of `levels`. On the probed layers
    (`probed_layers`), `measure(layer, {slot: threshold})` gives the KL with those slots of
    that layer thresholded: the layer's floor (every slot at 0, nothing dropped), then each
    slot alone at `probes`; a slot's gain at a probe is the KL it adds over the floor per unit
    of its proxy error there. A layer between two probed ones takes their gains interpolated
    in depth, applied to its own proxy errors."""
    gains: dict[tuple[int, str], list[float]] = {}
    for i in probed_layers(n_layers, every):
        floor = measure(i, {s: 0.0 for s in SLOTS})
        measured = {}
        for slot in SLOTS:
            st = stats[(i, slot)]
            measured[slot] = [measure(i, {slot: st.threshold(p)}) for p in probes]
            gains[(i, slot)] = [max(0.0, kl - floor) / max(st.error(p), 1e-12)
                                for p, kl in zip(probes, measured[slot])]
        log(f"layer {i}: KL floor {floor:.4f}; at " + "/".join(f"{p:.0%}" for p in probes)
            + " " + ", ".join(f"{s} " + "/".join(f"{kl:.4f}" for kl in measured[s])
                              for s in SLOTS))
    probed = sorted({i for i, _ in gains})
    costs = {}
    for i in range(n_layers):
        below = max(j for j in probed if j <= i)
        above = min(j for j in probed if j >= i)
        w = 0.0 if above == below else (i - below) / (above - below)
        for slot in SLOTS:
            st = stats[(i, slot)]
            g = [(1 - w) * a + w * b for a, b in zip(gains[(below, slot)], gains[(above, slot)])]
            costs[(i, slot)] = cost_curve(st, [(p, gp * st.error(p)) for p, gp in zip(probes, g)],
                                          levels)
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
