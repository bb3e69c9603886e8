"""Which cold neurons the CPU side computes for a token (a `hybrid.ffn.Selector`).

- `None` (no selector): all of them, the dense result.
- `tests/oracle_selector.py`'s `OracleSelector` (the yardstick, kept with the tests): the
  truly active ones, found by computing every cold neuron's activation first.
- `PredictorSelector`: a trained per-layer predictor's verdict (what `--profile` runs).
"""

from __future__ import annotations

import torch


class PredictorSelector:
    """Adapts a layer predictor (x (T, hidden) -> bool mask (T, ffn) over the whole layer)
    to the cold side's local numbering."""

    def __init__(self, predict, cold_idx: torch.Tensor):
        self.predict, self.cold_idx = predict, cold_idx

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, cold) bool: the predicted-active cold neurons of each row."""
        return self.predict(x).index_select(1, self.cold_idx)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(self.mask(x).any(dim=0)).flatten()
