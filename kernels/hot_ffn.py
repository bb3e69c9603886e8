"""The GPU tier's FFN: the hot neurons of a layer, computed with batched torch ops.

On the GPU tier every hot neuron is computed for every token (a GPU reads its weights at a
bandwidth where skipping a few percent of rows buys nothing, and a dense matmul has no
gather), optionally masked afterwards by a predictor. The layout keeps one matmul per side:

    gate_up (hidden, 2n)   hot gate columns then hot up columns (gated activations), or
            (hidden, n)    hot up columns (plain "relu"/"relu2")
    down    (n, hidden)    the hot neurons' down weights, neuron-major

so a token costs two matmuls whatever the device. Nothing here imports a GPU library: the
tensors' device decides where it runs (CUDA when the tier is a GPU, the CPU in tests).
`reference_hot_ffn` states the semantics with the sparse kernel's reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.transformer import activate

from .sparse_ffn_reference import is_gated, reference_sparse_ffn


@dataclass(frozen=True)
class HotFFNWeights:
    activation: str
    gate_up: torch.Tensor  # (hidden, 2n) or (hidden, n), see the module docstring
    down: torch.Tensor  # (n, hidden)

    @classmethod
    def from_rows(cls, gate: torch.Tensor | None, up: torch.Tensor, down_nm: torch.Tensor,
                  activation: str, device: torch.device | str = "cpu") -> "HotFFNWeights":
        """From neuron-major rows (n, hidden) each (gate None for plain activations)."""
        if is_gated(activation) != (gate is not None):
            raise ValueError(f"activation {activation!r} "
                             f"{'needs' if is_gated(activation) else 'takes no'} gate rows")
        cols = up.t() if gate is None else torch.cat((gate, up), dim=0).t()
        return cls(activation, cols.float().contiguous().to(device),
                   down_nm.float().contiguous().to(device))

    @property
    def n(self) -> int:
        return self.down.shape[0]

    @property
    def device(self) -> torch.device:
        return self.down.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


def hot_ffn(x: torch.Tensor, w: HotFFNWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, hidden) on w's device -> (T, hidden): sum over hot neurons of h * down row.

    mask (T, n) bool, optional: neurons to drop per token (a predictor's verdict)."""
    if w.n == 0:
        return torch.zeros_like(x)
    both = x @ w.gate_up  # (T, 2n) or (T, n)
    if is_gated(w.activation):
        gate, up = both.split(w.n, dim=1)
    else:
        gate, up = None, both
    h = activate(w.activation, gate, up)  # (T, n)
    if mask is not None:
        h = h * mask
    return h @ w.down


def reference_hot_ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                      down_nm: torch.Tensor, activation: str,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Same result from the sparse kernel's reference semantics (rows (n, hidden))."""
    if mask is None:
        return reference_sparse_ffn(x, gate, up, down_nm, None, activation)
    rows = [reference_sparse_ffn(x[t:t + 1], gate, up, down_nm,
                                 torch.nonzero(mask[t]).flatten(), activation)
            for t in range(x.shape[0])]
    return torch.cat(rows) if rows else torch.zeros_like(x)
