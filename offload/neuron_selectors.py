"""Which cold neurons the CPU side computes for a token (a `hybrid_ffn.Selector`).

- `None` (no selector): all of them, the dense result.
- `OracleSelector`: the truly active ones, found by computing every cold neuron's activation
  first. Useless for speed; it is the yardstick: on a ReLU-family model it must reproduce
  the dense output exactly, and it bounds what any predictor can reach.
- `PredictorSelector`: a trained per-layer predictor's verdict (what `--profile` runs).
"""

from __future__ import annotations

import torch

from ember.kernels.sparse_ffn import SparseFFNWeights
from ember.kernels.sparse_ffn_reference import dequantize_rows_int8
from ember.models.transformer import activate


class OracleSelector:
    def __init__(self, cold: SparseFFNWeights, threshold: float = 0.0):
        self.cold, self.threshold = cold, threshold

    def _rows(self, name: str):
        w = getattr(self.cold, name)
        if w is None:
            return None
        scale = getattr(self.cold, name.replace("_nm", "") + "_scale")
        return w if scale is None else dequantize_rows_int8(w, scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate = self._rows("gate")
        h = activate(self.cold.activation, None if gate is None else x @ gate.t(),
                     x @ self._rows("up").t())  # (T, cold)
        return torch.nonzero((h.abs() > self.threshold).any(dim=0)).flatten()


class PredictorSelector:
    """Adapts a layer predictor (x (T, hidden) -> bool mask (T, ffn) over the whole layer)
    to the cold side's local numbering."""

    def __init__(self, predict, cold_idx: torch.Tensor):
        self.predict, self.cold_idx = predict, cold_idx

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.predict(x).any(dim=0)  # (ffn,)
        return torch.nonzero(mask.index_select(0, self.cold_idx)).flatten()
