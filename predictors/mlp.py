"""The per-layer activation predictor: a small ReLU MLP giving one logit per FFN neuron.

Weights are stored (in, out) like the model's, so `x @ w1` applies the first layer. A neuron is
predicted active when its logit exceeds `threshold`, chosen on held-out tokens for a target
recall (see `train.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ember.models.support.errors import ModelFormatError

_NAMES = ("w1", "b1", "w2", "b2", "threshold")


@dataclass
class Predictor:
    w1: torch.Tensor  # (hidden, rank)
    b1: torch.Tensor  # (rank,)
    w2: torch.Tensor  # (rank, ffn)
    b2: torch.Tensor  # (ffn,)
    threshold: float  # logit above which a neuron is predicted active

    @property
    def hidden(self) -> int:
        return self.w1.shape[0]

    @property
    def rank(self) -> int:
        return self.w1.shape[1]

    @property
    def ffn(self) -> int:
        return self.w2.shape[1]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, ffn) float logits."""
        return torch.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, ffn) bool: the neurons to compute."""
        return self.logits(x) > self.threshold

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.b1, self.w2, self.b2))

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Name -> contiguous tensor, for safetensors (the threshold as a 1-element tensor)."""
        out = {prefix + n: getattr(self, n).contiguous() for n in _NAMES[:4]}
        out[prefix + "threshold"] = torch.tensor([self.threshold], dtype=torch.float32)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], hidden: int, ffn: int,
                     prefix: str = "", source: str = "predictor artifact") -> "Predictor":
        """Rebuild from `to_tensors` output, checking every shape against the model's sizes."""
        missing = [prefix + n for n in _NAMES if prefix + n not in tensors]
        if missing:
            raise ModelFormatError(source, f"predictor tensors missing: {', '.join(missing)}")
        t = {n: tensors[prefix + n] for n in _NAMES}
        if t["w1"].dim() != 2 or t["w1"].shape[0] != hidden or t["w1"].shape[1] < 1:
            raise ModelFormatError(source, f"'{prefix}w1' has shape {tuple(t['w1'].shape)}, "
                                           f"expected ({hidden}, rank)")
        rank = t["w1"].shape[1]
        expected = {"b1": (rank,), "w2": (rank, ffn), "b2": (ffn,), "threshold": (1,)}
        for n, shape in expected.items():
            if tuple(t[n].shape) != shape:
                raise ModelFormatError(source, f"'{prefix}{n}' has shape {tuple(t[n].shape)}, "
                                               f"expected {shape}")
        for n in _NAMES:
            if not t[n].is_floating_point():
                raise ModelFormatError(source, f"'{prefix}{n}' must be a float tensor, "
                                               f"not {t[n].dtype}")
        threshold = float(t["threshold"][0])
        if math.isnan(threshold):
            raise ModelFormatError(source, f"'{prefix}threshold' is NaN")
        return cls(*(t[n].float().contiguous() for n in _NAMES[:4]), threshold)


@dataclass
class PredictorSet:
    """Every layer's predictor (None: the layer runs dense) and its |h| activity threshold."""

    predictors: list[Predictor | None]
    activation_thresholds: list[float]  # |h| > this counts as active (0 for ReLU models)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        thresholds = torch.tensor(self.activation_thresholds, dtype=torch.float32)
        out = {"activation_thresholds": thresholds}
        for i, p in enumerate(self.predictors):
            if p is not None:
                out.update(p.to_tensors(f"blk.{i}.predictor."))
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], n_layers: int, hidden: int, ffn: int,
                     source: str = "predictor artifact") -> "PredictorSet":
        thresholds = tensors.get("activation_thresholds")
        if thresholds is None or tuple(thresholds.shape) != (n_layers,):
            got = None if thresholds is None else tuple(thresholds.shape)
            raise ModelFormatError(source, f"'activation_thresholds' has shape {got}, "
                                           f"expected ({n_layers},)")
        known = {"activation_thresholds"} | {f"blk.{i}.predictor.{n}" for i in range(n_layers)
                                             for n in _NAMES}
        stray = sorted(set(tensors) - known)
        if stray:
            raise ModelFormatError(source, "unexpected tensors (another model's artifact?): "
                                           + ", ".join(stray[:3]))
        predictors = [Predictor.from_tensors(tensors, hidden, ffn, f"blk.{i}.predictor.", source)
                      if f"blk.{i}.predictor.w1" in tensors else None for i in range(n_layers)]
        return cls(predictors, [float(v) for v in thresholds])
