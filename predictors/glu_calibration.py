"""Per-layer |h| thresholds for GLU models (GeGLU, SwiGLU) under a perplexity budget.

GLU activations are never exactly zero, so "inactive" must be defined: a neuron is skipped on a
token when |h| <= tau_l x the token's mean |h| (`stats.is_active`). Layers differ a lot in how
much of that they tolerate, so one global sparsity wastes the budget. The search:

1. Local error: on sampled FFN inputs, for each candidate sparsity s, tau_l(s) is the s-quantile
   of |h| / mean|h| and e_l(s) the mean squared change of the layer's (post-normed) FFN output
   when the inactive entries are dropped (optionally adding their calibration mean back as a
   bias: on Gemma 3 270M that made things worse, KL 0.017 -> 0.057 at 50%, so it is off).
2. Sensitivity: probes of each layer alone at two sparsities (the rest dense), re-running only
   the blocks from that layer on, give the KL divergence from the dense model; the ratio
   KL / e_l, interpolated between the probes, turns local error into predicted KL_l(s).
3. Allocation: greedily take the sparsity step with the least predicted KL per unit of
   sparsity until the predicted total reaches a share of the target (a share of
   log(1 + budget) nats).
4. Verification: the whole thresholded model on the calibration tokens, KL and NLL change
   against dense. Layers' errors compound (on Gemma 3 270M the sum of single-layer KLs
   underestimated the combination several times over), so the share is bisected against the
   verified result; uniform allocations are bisected too, and the sparser allocation within
   the target wins.
5. Report: perplexity ratio and top-1 agreement against dense on held-out tokens.
KL and perplexity are computed over a shortlist of the vocabulary during steps 2-4 (each
position's dense top candidates and its target): the full LM head would dominate the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ember.models.support.errors import ConfigError
from ember.models.transformer import Transformer

from .ffn_swap import intermediate, swapped_ffns
from .glu_probe import KLProbe, LocalCurve, local_curve
from .passes import Scores, check_length, score
from .stats import Collection, is_active

DEFAULT_LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 18))  # 0.05 .. 0.85


@dataclass
class CalibrationOptions:
    budget: float = 0.03  # allowed perplexity increase on held-out text (0.03 = +3%)
    target_share: float = 0.7  # first aim at this share of the budget (held-out text differs)
    levels: tuple[float, ...] = DEFAULT_LEVELS  # candidate per-layer sparsities
    probes: tuple[float, ...] = (0.5, 0.8)  # sparsities of the per-layer sensitivity probes
    compensate: bool = False  # add the calibration mean of the dropped h back as a bias
    local_tokens: int = 512  # sampled tokens for the local errors
    probe_tokens: int = 512  # calibration tokens the probes and verifications run on
    shortlist_top: int = 32  # dense top-k tokens per position kept in the KL shortlist
    length: int = 512  # tokens per forward segment
    rounds: int = 4  # verifications per family of allocations (per-layer, uniform)

    def validate(self) -> None:
        if not 0 < self.budget < 10:
            raise ConfigError(f"budget is a perplexity increase such as 0.03; got {self.budget}")
        if not 0 < self.target_share <= 1:
            raise ConfigError(f"target_share must be in (0, 1], got {self.target_share}")
        if not self.levels or any(not 0 < s < 1 for s in self.levels):
            raise ConfigError("sparsity levels must lie strictly between 0 and 1")
        if not self.probes or any(not 0 < s < 1 for s in self.probes):
            raise ConfigError(f"probe sparsities must lie strictly between 0 and 1, "
                              f"got {self.probes}")
        if self.rounds < 1 or self.local_tokens < 1 or self.probe_tokens < 2:
            raise ConfigError("rounds, local_tokens must be >= 1 and probe_tokens >= 2")


@dataclass
class LayerSparsity:
    layer: int
    threshold: float  # skip a neuron on a token when |h| <= threshold * the token's mean |h|
    sparsity: float  # fraction skipped on the calibration sample
    held_out_sparsity: float = float("nan")  # fraction skipped on the held-out tokens
    bias: torch.Tensor | None = None  # (hidden,) added to the FFN output (compensation)


@dataclass
class GLUCalibration:
    layers: list[LayerSparsity]
    dense: Scores  # held-out
    sparse: Scores  # held-out, thresholded model
    predicted_kl: float  # nats/token the allocation expected
    measured_kl: float  # nats/token on the calibration tokens (shortlist)
    trials: list = field(default_factory=list)  # every verified allocation, in order

    @property
    def ppl_ratio(self) -> float:
        return self.sparse.ppl / self.dense.ppl

    @property
    def agreement(self) -> float:
        return self.dense.agreement(self.sparse)

    @property
    def thresholds(self) -> list[float]:
        return [layer.threshold for layer in self.layers]

    @property
    def mean_sparsity(self) -> float:
        return sum(layer.sparsity for layer in self.layers) / max(1, len(self.layers))


class ThresholdedFFN(nn.Module):
    """A FeedForward computed in full whose inactive entries of h are zeroed (what a perfect
    predictor would let the sparse FFN skip), plus an optional bias; counts what it drops."""

    def __init__(self, ffn: nn.Module, threshold: float = 0.0, bias: torch.Tensor | None = None):
        super().__init__()
        self.ffn, self.threshold, self.bias = ffn, threshold, bias
        self.dropped = self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = intermediate(self.ffn, x)
        if self.threshold > 0:
            keep = is_active(h.abs(), self.threshold)
            self.dropped += int((~keep).sum())
            h = h * keep
        self.seen += h.numel()
        out = h @ self.ffn.down
        return out if self.bias is None else out + self.bias


def _allocate(costs: torch.Tensor, levels: list[float], budget: float) -> list[int]:
    """Per layer a level index (-1 = dense) maximizing total sparsity with summed predicted KL
    within budget: repeatedly take the step with the least KL per unit of sparsity."""
    n_layers, n_levels = costs.shape
    chosen = [-1] * n_layers
    spent = 0.0
    while True:
        best = None
        for layer in range(n_layers):
            k = chosen[layer]
            now_s = levels[k] if k >= 0 else 0.0
            now_c = float(costs[layer, k]) if k >= 0 else 0.0
            for j in range(k + 1, n_levels):
                extra = max(0.0, float(costs[layer, j]) - now_c)
                if spent + extra > budget:
                    continue
                rate = extra / (levels[j] - now_s)
                if best is None or rate < best[0]:
                    best = (rate, layer, j, extra)
        if best is None:
            return chosen
        _, layer, j, extra = best
        chosen[layer], spent = j, spent + extra


# ---- the search ---------------------------------------------------------------------------

def calibrate_glu(model: Transformer, collection: Collection, calib_ids: list[int],
                  held_out_ids: list[int], bos_id: int | None,
                  options: CalibrationOptions | None = None, log=None,
                  progress=None) -> GLUCalibration:
    """Choose per-layer |h| thresholds meeting the options' perplexity budget.

    Args:
        collection: a dense `collect()` pass over calibration text (its sampled FFN inputs).
        calib_ids: calibration tokens for probes and verification (may be the collection's).
        held_out_ids: tokens never used for choosing, for the final report.
        log: optional callable(str) for progress lines.
        progress: optional callable(fraction, stage), counted in forward passes over the
            probe text (single-layer probes, then trials, then the held-out scores).
    Returns:
        per-layer thresholds and sparsities; held-out perplexity ratio and top-1 agreement.
    """
    opts = options or CalibrationOptions()
    opts.validate()
    check_length(model, opts.length)
    say = log or (lambda _msg: None)
    levels = sorted(opts.levels)
    passes = [0, len(model.blocks) * len(opts.probes) + 2 * opts.rounds + 2]  # done, expected

    def passed(stage: str) -> None:
        passes[0] += 1
        if progress is not None:
            progress(min(1.0, passes[0] / passes[1]), stage)

    if len(collection.samples) != len(model.blocks) or len(collection.samples[0]) == 0:
        raise ConfigError("the collection does not match this model or holds no sampled tokens")
    probes = sorted(opts.probes)
    curves = [local_curve(block, sample.inputs()[: opts.local_tokens], levels + probes,
                           opts.compensate)
              for block, sample in zip(model.blocks, collection.samples)]
    probe = KLProbe(model, calib_ids[: opts.probe_tokens], bos_id, opts.length, opts.shortlist_top)
    costs = torch.stack([_sensitivity(model, probe, layer, curve, levels, probes, say, passed)
                         for layer, curve in enumerate(curves)])  # (layers, levels) predicted KL
    target = opts.target_share * math.log1p(opts.budget)
    trials: list[_Trial] = []

    def trial(family: str, param: float, chosen: list[int]) -> bool:
        kl, dnll = _verify(model, probe, curves, chosen)
        passed(f"{family} trial {len(trials) + 1}")
        t = _Trial(family, param, chosen, _mean_sparsity(chosen, levels), kl, dnll,
                   max(kl, dnll) <= target)
        trials.append(t)
        say(f"{family} {param:.3g}: mean sparsity {t.sparsity:.3f}, KL {kl:.4f}, dNLL {dnll:.4f}"
            f"{'' if t.ok else ' (over budget)'}")
        return t.ok

    # Per-layer allocations, scaled by the share of the budget the sum of single-layer KLs may
    # use (layers compound, so the right share is found by bisection), and uniform ones as a
    # safety net: whichever family keeps more sparsity within budget wins.
    _bisect(lambda share: trial("per-layer", share, _allocate(costs, levels, share * target)),
            lo=0.0, hi=None, start=1.0, rounds=opts.rounds)
    _bisect(lambda k: trial("uniform", levels[int(k)], [int(k)] * len(curves)),
            lo=-1, hi=len(levels), start=len(levels) // 2, rounds=opts.rounds, integer=True)
    ok = [t for t in trials if t.ok]
    dense_trial = _Trial("dense", 0, [-1] * len(curves), 0, 0, 0, True)  # nothing met the target
    best = max(ok, key=lambda t: t.sparsity) if ok else dense_trial
    layers = [LayerSparsity(i, c.thresholds[k], levels[k], bias=c.biases[k]) if k >= 0
              else LayerSparsity(i, 0.0, 0.0) for i, (c, k) in enumerate(zip(curves, best.chosen))]
    dense, sparse = _held_out(model, layers, held_out_ids, bos_id, opts.length, passed)
    predicted = float(sum(costs[i, k] for i, k in enumerate(best.chosen) if k >= 0))
    return GLUCalibration(layers, dense, sparse, predicted, best.kl, trials)


def _held_out(model: Transformer, layers: list[LayerSparsity], ids: list[int],
              bos_id: int | None, length: int, passed) -> tuple[Scores, Scores]:
    """Dense and thresholded scores on held-out ids; records each layer's realized sparsity."""
    dense = score(model, ids, length, bos_id)
    passed("held-out check")

    def thresholded(i, f):
        return ThresholdedFFN(f, layers[i].threshold, layers[i].bias)

    with swapped_ffns(model, thresholded) as wrappers:
        sparse = score(model, ids, length, bos_id)
        for layer, w in zip(layers, wrappers):
            layer.held_out_sparsity = w.dropped / max(1, w.seen)
    passed("held-out check")
    return dense, sparse


@dataclass
class _Trial:
    family: str  # "per-layer" (param: budget share) or "uniform" (param: sparsity)
    param: float
    chosen: list[int]  # level index per layer, -1 dense
    sparsity: float  # mean over layers
    kl: float  # nats/token on the calibration tokens
    dnll: float
    ok: bool


def _mean_sparsity(chosen: list[int], levels: list[float]) -> float:
    return sum(levels[k] if k >= 0 else 0.0 for k in chosen) / len(chosen)


def _sensitivity(model, probe: KLProbe, layer: int, curve: LocalCurve, levels: list[float],
                 probes: list[float], say, passed) -> torch.Tensor:
    """Predicted KL of `layer` alone at each level: local error x a gain measured at the probe
    sparsities (KL per unit of local error grows with sparsity; interpolated between probes)."""
    n = len(levels)
    gains = []
    for j, s in enumerate(probes):
        tau, bias = curve.thresholds[n + j], curve.biases[n + j]
        with swapped_ffns(model, lambda i, f: ThresholdedFFN(f, tau, bias), [layer]):
            kl, _ = probe.run(layer)
        gains.append(kl / max(float(curve.errors[n + j]), 1e-30))
        say(f"layer {layer}: KL {kl:.4f} alone at sparsity {s:.2f}")
        passed(f"layer {layer + 1} of {len(model.blocks)}")
    gain = torch.tensor([_interp(s, probes, gains) for s in levels], dtype=torch.float64)
    return gain * curve.errors[:n]


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _bisect(ok, lo, hi, start, rounds: int, integer: bool = False) -> None:
    """Probe `ok(param)` (monotone: true below some point) `rounds` times, closing in on the
    largest param for which it holds. hi=None: unbounded above (doubles until it fails)."""
    x = start
    for _ in range(rounds):
        if ok(x):
            lo = x
        else:
            hi = x
        if hi is None:
            x = lo * 2
        elif integer:
            if hi - lo <= 1:
                return
            x = (lo + hi) // 2
        else:
            x = (lo + hi) / 2


def _verify(model, probe: KLProbe, curves: list[LocalCurve],
            chosen: list[int]) -> tuple[float, float]:
    def make(i, f):
        k = chosen[i]
        return ThresholdedFFN(f, curves[i].thresholds[k], curves[i].biases[k]) if k >= 0 else f

    with swapped_ffns(model, make):
        return probe.run(0)
