"""Train each layer's activation predictor on a statistics pass's sampled tokens.

Class-weighted BCE (each neuron's positives weighted by its negative/positive ratio, so rare
activations are not ignored), Adam, then a decision threshold set on held-out sample tokens
for the target recall. Ranks are tried smallest first; the one with the least total work
(predictor + the FFN neurons it lets through) wins, and a layer whose best predictor costs
more than the FFN work it saves runs dense.

"Work" is bytes of weights read per token, since batch-1 decoding is memory-bound: the
predictor's float32 weights, the neurons it lets through at the sparse path's bytes per weight
(int8 bundles), against the whole FFN at the dense path's (Q8_0 blocks). Counting flops
instead kept predictors that flag 93% of neurons and made decoding twice as slow as dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ember.models.config import ModelConfig
from ember.models.support.errors import ConfigError

from .mlp import Predictor, PredictorSet
from .stats import Collection


@dataclass
class TrainOptions:
    recall: float = 0.95  # fraction of truly active (token, neuron) pairs to catch
    recall_margin: float = 0.01  # aim this much higher on the validation split
    ranks: tuple[int, ...] = (64, 128, 256)  # candidate hidden widths, tried in this order
    epochs: int = 20
    batch: int = 256
    lr: float = 2e-3
    validation: float = 0.2  # share of sampled tokens (the latest) held out for thresholds
    max_pos_weight: float = 50.0
    max_cost_ratio: float = 1.0  # predictor bytes / FFN bytes saved above this: run dense
    dense_bytes_per_weight: float = 34 / 32  # the dense FFN's weights (Q8_0 blocks)
    sparse_bytes_per_weight: float = 1.0  # the sparse path's weights (int8 neuron bundles)
    seed: int = 0

    def validate(self) -> None:
        if not 0 < self.recall <= 1:
            raise ConfigError(f"recall must be in (0, 1], got {self.recall}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ConfigError("predictor ranks must be positive integers")
        if not 0 < self.validation < 1:
            raise ConfigError(f"validation must be between 0 and 1, got {self.validation}")
        if self.epochs < 1 or self.batch < 1 or self.lr <= 0:
            raise ConfigError("epochs and batch must be >= 1 and lr > 0")


@dataclass
class Quality:
    recall: float
    precision: float
    predicted_fraction: float  # share of (token, neuron) pairs predicted active
    true_fraction: float  # share actually active


@dataclass
class LayerReport:
    layer: int
    rank: int  # 0: no predictor (dense layer)
    quality: Quality | None  # on the validation split
    cost_ratio: float  # predictor bytes / dense FFN bytes saved; inf when nothing is saved

    @property
    def dense(self) -> bool:
        return self.rank == 0


def ffn_weights(cfg: ModelConfig) -> int:
    """Weights of one FFN layer: gate (if any), up and down projections."""
    return cfg.hidden_size * cfg.ffn_size * (3 if cfg.gated else 2)


def sparse_bytes(predictor: Predictor, cfg: ModelConfig, predicted_fraction: float,
                 opts: TrainOptions) -> float:
    """Bytes a token reads on the sparse path: the predictor, then the neurons it flags."""
    return predictor.nbytes + ffn_weights(cfg) * opts.sparse_bytes_per_weight * predicted_fraction


def evaluate(predictor: Predictor, x: torch.Tensor, target: torch.Tensor) -> Quality:
    """Recall, precision and active fractions of `predictor` on x (N, hidden), target (N, ffn)."""
    with torch.no_grad():
        pred = predictor.predict(x)
    tp = float((pred & target).sum())
    positives, predicted = float(target.sum()), float(pred.sum())
    return Quality(recall=tp / positives if positives else 1.0,
                   precision=tp / predicted if predicted else 1.0,
                   predicted_fraction=predicted / target.numel(),
                   true_fraction=positives / target.numel())


def cost_ratio(predictor: Predictor, cfg: ModelConfig, predicted_fraction: float,
               opts: TrainOptions) -> float:
    """Predictor bytes over the FFN bytes its sparsity saves against the dense path."""
    saved = ffn_weights(cfg) * (opts.dense_bytes_per_weight
                                - opts.sparse_bytes_per_weight * predicted_fraction)
    return predictor.nbytes / saved if saved > 0 else float("inf")


def _threshold(logits: torch.Tensor, target: torch.Tensor, recall: float) -> float:
    """The largest logit threshold that keeps `recall` of the positives strictly above it."""
    pos = logits[target].sort().values
    if pos.numel() == 0:
        return float("inf")  # never active here: predict nothing
    k = int((1.0 - recall) * pos.numel())  # positives allowed below the threshold
    return float(torch.nextafter(pos[k], torch.tensor(float("-inf"))))


def train_layer(x: torch.Tensor, target: torch.Tensor, x_val: torch.Tensor,
                target_val: torch.Tensor, rank: int, opts: TrainOptions,
                on_epoch: Callable[[int], None] | None = None) -> Predictor:
    """One predictor of width `rank`: trained on (x, target), thresholded on the validation set.
    `on_epoch(e)`, if given, is called after epoch e (0-based) ends."""
    g = torch.Generator().manual_seed(opts.seed)
    hidden, ffn = x.shape[1], target.shape[1]
    w1 = (torch.randn(hidden, rank, generator=g) * hidden ** -0.5).requires_grad_()
    b1 = torch.zeros(rank, requires_grad=True)
    w2 = (torch.randn(rank, ffn, generator=g) * rank ** -0.5).requires_grad_()
    pos = target.float().sum(0)
    # Output biases start at each neuron's base rate.
    b2 = torch.logit((pos / len(target)).clamp(1e-3, 1 - 1e-3)).requires_grad_()
    pos_weight = ((len(target) - pos) / pos.clamp(min=1)).clamp(1.0, opts.max_pos_weight)
    # Inputs are standardized inside the first layer's weights afterwards, so training is
    # insensitive to the residual stream's scale (Gemma's FFN inputs reach the hundreds).
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    xs = (x - mean) / std
    params = [w1, b1, w2, b2]
    optim = torch.optim.Adam(params, lr=opts.lr)
    with torch.enable_grad():
        for epoch in range(opts.epochs):
            for idx in torch.randperm(len(xs), generator=g).split(opts.batch):
                logits = torch.relu(xs[idx] @ w1 + b1) @ w2 + b2
                loss = F.binary_cross_entropy_with_logits(logits, target[idx].float(),
                                                          pos_weight=pos_weight)
                optim.zero_grad()
                loss.backward()
                optim.step()
            if on_epoch is not None:
                on_epoch(epoch)
    with torch.no_grad():
        w1_raw = w1 / std[:, None]  # ((x - mean) / std) @ w1 == x @ (w1 / std) - (mean / std) @ w1
        b1_raw = b1 - (mean / std) @ w1
        predictor = Predictor(w1_raw.contiguous(), b1_raw, w2.detach().clone(),
                              b2.detach().clone(), 0.0)
        aim = min(1.0, opts.recall + opts.recall_margin)
        predictor.threshold = _threshold(predictor.logits(x_val), target_val, aim)
    return predictor


def train_predictors(collection: Collection, cfg: ModelConfig, options: TrainOptions | None = None,
                     log=None, progress: Callable[[float, str], None] | None = None,
                     ) -> tuple[PredictorSet, list[LayerReport]]:
    """A predictor per layer from `collect()`'s samples; targets are |h| > the layer's threshold.
    `progress(fraction, stage)`, if given, is called after every epoch.

    Returns the set (None for dense layers) and a per-layer report on the validation split.
    """
    opts = options or TrainOptions()
    opts.validate()
    say = log or (lambda _msg: None)
    predictors, reports = [], []
    for layer, (stats, sample) in enumerate(zip(collection.stats, collection.samples)):
        x, target = sample.inputs(), sample.targets(stats.threshold)
        cut = int(len(x) * (1 - opts.validation))
        if cut < 1 or cut == len(x):
            raise ConfigError(f"layer {layer}: {len(x)} sampled tokens are too few to train and "
                              f"validate a predictor; collect more calibration text")
        best = None
        ranks = sorted(opts.ranks)
        for r, rank in enumerate(ranks):
            # Each layer's share of the bar split evenly among its ranks: a layer that stops at
            # an early rank jumps ahead, so the bar never runs backwards.
            def epoch_done(e: int, layer=layer, r=r) -> None:
                if progress is not None:
                    done = layer + (r + (e + 1) / opts.epochs) / len(ranks)
                    progress(done / len(collection.stats), f"layer {layer + 1} of "
                             f"{len(collection.stats)}, rank {ranks[r]}, epoch {e + 1}")

            p = train_layer(x[:cut], target[:cut], x[cut:], target[cut:], rank, opts, epoch_done)
            q = evaluate(p, x[cut:], target[cut:])
            total = sparse_bytes(p, cfg, q.predicted_fraction, opts)
            say(f"layer {layer} rank {rank}: recall {q.recall:.3f} precision {q.precision:.3f} "
                f"predicted {q.predicted_fraction:.3f} (true {q.true_fraction:.3f})")
            if best is not None and total >= best[0]:
                break  # a wider predictor no longer pays for itself
            best = (total, p, q)
        _, p, q = best
        ratio = cost_ratio(p, cfg, q.predicted_fraction, opts)
        if ratio >= opts.max_cost_ratio:
            predictors.append(None)
            reports.append(LayerReport(layer, 0, q, ratio))
        else:
            predictors.append(p)
            reports.append(LayerReport(layer, p.rank, q, ratio))
    return PredictorSet(predictors, [s.threshold for s in collection.stats]), reports


def retune_thresholds(predictors: PredictorSet, collection: Collection, recall: float,
                      validation: float = 0.2) -> list[Quality | None]:
    """Move every predictor's decision threshold to reach `recall` on the validation split
    (the same latest share of samples training held out); weights are unchanged. For when
    the end-to-end check finds the predictors' misses cost more quality than allowed.
    Returns each layer's validation quality at the new threshold (None for dense layers)."""
    if not 0 < recall <= 1:
        raise ConfigError(f"recall must be in (0, 1], got {recall}")
    out: list[Quality | None] = []
    for p, stats, sample in zip(predictors.predictors, collection.stats, collection.samples):
        if p is None:
            out.append(None)
            continue
        x, target = sample.inputs(), sample.targets(stats.threshold)
        cut = int(len(x) * (1 - validation))
        x_val, target_val = x[cut:], target[cut:]
        p.threshold = _threshold(p.logits(x_val), target_val, recall)
        out.append(evaluate(p, x_val, target_val))
    return out
