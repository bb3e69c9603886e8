"""The cold side of a split GLU layer computed from the file's own blocks (`--cold-dtype file`).

The default cold side packs each cold neuron's gate, up and down rows into an int8 bundle
(kernels/sparse_ffn.py): one sequential stream per neuron, but 8.5 bits a weight where a
Q4_K_M file stores 4.5-6.6, so a split model held the file and a second, bigger copy of its
cold FFN. Here the cold neurons keep the file's bytes:

    gate/up: the cold neurons' rows, copied verbatim from the file's tensors (row bytes are
             per neuron in GGUF's layout), run by the dense block kernels
             (kernels/block_matmul.py) on every token;
    down:    the layer's whole down matrix as input-major tiles (kernels/input_sparse.py:
             the file's blocks re-ordered, nothing rounded again), read only at the columns
             of the cold neurons a token keeps. The hot neurons' inputs are zero there, so
             they are never read; a profile's down threshold (issue 18) drops the cold
             neurons whose act(gate) * up is at or under it.

Both kernels round x to int8 per block as llama.cpp does, so the values are those the
unsplit model computes on the file's blocks. A layer whose types the tiles do not hold, a
plain (non-GLU) activation, or a layer a predictor gates (it wants a subset of the gate/up
rows) keeps the bundles.
"""

from __future__ import annotations

import numpy as np
import torch

from ember.kernels import input_sparse as isp
from ember.kernels.block_matmul import block_matmul, supports
from ember.models.activations import is_gated
from ember.models.transformer import activate


class FileColdFFN:
    """The cold neurons of one layer, in the file's blocks (see the module docstring)."""

    def __init__(self, rows, cold_idx: np.ndarray):
        idx = torch.from_numpy(np.asarray(cold_idx, dtype=np.int64))
        self.activation = rows.activation
        self.ffn_size, self.hidden = rows.ffn_size, rows.hidden
        self.cold_idx = idx
        self.gate_up = [t.select_rows(idx) for t in rows.gate_up]  # verbatim row bytes
        self.down = isp.relayout(rows.down)  # (hidden, ffn) input-major: every neuron's column

    @staticmethod
    def fits(rows, has_selector: bool) -> bool:
        """Whether a layer's rows can run here: a GLU layer on the file's blocks, with no
        predictor, types the kernels hold."""
        return (not has_selector and hasattr(rows, "gate_up") and is_gated(rows.activation)
                and all(supports(t.qtype) for t in rows.gate_up) and isp.tiled(rows.down.qtype)
                and isp.available())

    @property
    def nbytes(self) -> int:
        """Host bytes held: the cold gate/up rows and the whole down as tiles."""
        return sum(t.nbytes for t in self.gate_up) + self.down.nbytes

    def __call__(self, x: torch.Tensor, down_threshold: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) fp32 -> (the cold neurons' part of the FFN output (T, hidden), the
        neurons each token kept (T,) int64)."""
        n = len(self.cold_idx)
        gate_up = block_matmul(x, self.gate_up)
        h = activate(self.activation, gate_up[:, :n], gate_up[:, n:])
        full = x.new_zeros(x.shape[0], self.ffn_size)
        full.index_copy_(1, self.cold_idx, h)
        # Threshold 0 still drops exact zeros: the hot neurons' inputs, never read here.
        out = isp.input_sparse_matmul(full, [self.down], down_threshold or 0.0)
        kept = (full.abs() > (down_threshold or 0.0)).sum(dim=1)
        return out, kept
