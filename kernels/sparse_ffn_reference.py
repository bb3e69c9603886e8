"""Plain PyTorch semantics of the sparse FFN: what every fast kernel is tested against.

Layout ("neuron-major bundling"): for an FFN with `ffn` neurons over `hidden` features,
    gate (ffn, hidden)     rows; None for plain MLP activations ("relu", "relu2")
    up   (ffn, hidden)     rows
    down_nm (ffn, hidden)  the transpose of the usual (hidden, ffn) down matrix, so one
                           neuron's down weights are one contiguous row
For x (T, hidden) and a set of active neurons A:
    h[t, i] = act(gate[i] . x[t], up[i] . x[t])        (i in A)
    out[t]  = sum_{i in A} h[t, i] * down_nm[i]          -> (T, hidden)
Duplicates in A count twice (the fast kernel does the same).

int8 weights are symmetric per row: w[i, :] ~= q[i, :] * scale[i], q in [-127, 127].
"""

from __future__ import annotations

import torch

from ember.models.config import ACTIVATIONS, PLAIN_ACTIVATIONS
from ember.models.transformer import activate

__all__ = [
    "ACTIVATIONS", "is_gated", "quantize_rows_int8", "dequantize_rows_int8",
    "reference_sparse_ffn", "reference_dense_ffn",
]


def is_gated(activation: str) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    return activation not in PLAIN_ACTIVATIONS


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w (rows, cols) -> (q int8 (rows, cols), scale fp32 (rows,)).

    scale = max|row| / 127, so each weight is off by at most scale / 2. An all-zero row gets
    scale 0 (and q 0), which reproduces it exactly.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_rows_int8 expects a 2-D tensor, got shape {tuple(w.shape)}")
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def _rows(w: torch.Tensor | None, scale: torch.Tensor | None, idx: torch.Tensor | None):
    """The selected rows as fp32 (a gathered copy: fine for a reference, not for speed)."""
    if w is None:
        return None
    if idx is not None:
        w = w.index_select(0, idx)
        scale = scale.index_select(0, idx) if scale is not None else None
    return dequantize_rows_int8(w, scale) if scale is not None else w.float()


def reference_sparse_ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                         down_nm: torch.Tensor, active_idx: torch.Tensor | None, activation: str,
                         *, gate_scale=None, up_scale=None, down_scale=None) -> torch.Tensor:
    """out (T, hidden) from the active neurons only (active_idx None = all of them).

    Weights are fp32 rows, or int8 rows when the matching *_scale (ffn,) is given.
    """
    if is_gated(activation) != (gate is not None):
        raise ValueError(f"activation {activation!r} {'needs' if is_gated(activation) else 'takes no'} gate")
    idx = None if active_idx is None else active_idx.to(torch.long)
    g = _rows(gate, gate_scale, idx)
    u = _rows(up, up_scale, idx)
    d = _rows(down_nm, down_scale, idx)
    x = x.float()
    h = activate(activation, None if g is None else x @ g.t(), x @ u.t())  # (T, n_active)
    return h @ d  # (T, n_active) @ (n_active, hidden)


def reference_dense_ffn(x, gate, up, down_nm, activation, **scales) -> torch.Tensor:
    """Every neuron active: the dense FFN in the same layout."""
    return reference_sparse_ffn(x, gate, up, down_nm, None, activation, **scales)
