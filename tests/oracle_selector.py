"""The yardstick a cold-neuron selector is measured against: the truly active neurons, found
by computing every cold neuron's activation first. Useless for speed; on a ReLU-family model
it must reproduce the dense output exactly, and it bounds what any predictor can reach."""

from __future__ import annotations

import torch

from ember.kernels.ffn_bundles import dequantize_rows_int8
from ember.kernels.sparse_ffn import SparseFFNWeights
from ember.models.activations import activate


class OracleSelector:
    """Active = |h| > threshold (absolute). With threshold 0 that is exactly "h != 0", the
    ReLU-family rule. (Profiles of GLU models define activity relative to each token's mean
    |h| over the whole layer, which a cold-side-only oracle cannot see; their predictors
    learned that rule, so this oracle is for ReLU-family checks.)"""

    def __init__(self, cold: SparseFFNWeights, threshold: float = 0.0):
        self.cold, self.threshold = cold, threshold

    def _rows(self, name: str):
        w = getattr(self.cold, name)
        if w is None:
            return None
        scale = getattr(self.cold, name.replace("_nm", "") + "_scale")
        return w if scale is None else dequantize_rows_int8(w, scale)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, cold) bool: the truly active cold neurons of each row."""
        gate = self._rows("gate")
        h = activate(self.cold.activation, None if gate is None else x @ gate.t(),
                     x @ self._rows("up").t())
        return h.abs() > self.threshold

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(self.mask(x).any(dim=0)).flatten()
