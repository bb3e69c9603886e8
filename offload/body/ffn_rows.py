"""Where a hybrid split takes one FFN layer's neuron rows from.

The split (offload/hybrid/ffn.py) wants, for a set of neurons, their gate, up and down
weights as neuron-major float rows (n, hidden): the hot tier holds them as float, the cold
side packs them into bundles. Two sources give them:

- `FloatFFNRows`: the float32 reference `FeedForward` ((in, out) tensors), the legacy path
  (`--weights fp32/q8`, a GPU device).
- `FileFFNRows`: the file's own GGML blocks. Gate and up are (ffn, hidden) in GGUF, one row
  per neuron already, so a neuron's rows are dequantized straight from its blocks. Down is
  (hidden, ffn): a neuron's weights are a column, spread over every row's blocks, so its
  neuron-major form is derived once per layer (dequantize, transpose) while that layer is
  split, and dropped afterwards (`release`); only the sliced rows stay, in their homes.

Each source also names its dense twin (`dense`): what a layer that computes every neuron on
the host runs instead of the bundles (HybridFFN.dense_fallback).
"""

from __future__ import annotations

import torch

from ember.kernels import block_matmul as bm
from ember.models.activations import is_gated
from ember.models.transformer import FeedForward, activate
from ember.models.weights import QTensor

Rows = tuple["torch.Tensor | None", torch.Tensor, torch.Tensor]  # gate, up, down_nm (n, hidden)


class FloatFFNRows:
    """Rows of a float32 FeedForward (gate/up (hidden, ffn), down (ffn, hidden))."""

    def __init__(self, ffn: FeedForward):
        self.dense, self.activation = ffn, ffn.activation
        self.ffn_size = ffn.up.shape[1]

    def types(self) -> tuple[list[None], None]:
        """No file types: float32 rows (the GPU tier keeps them float32, see tier_dtypes)."""
        return [None] * (1 if self.dense.gate is None else 2), None

    def neuron_rows(self, idx: torch.Tensor) -> Rows:
        ffn = self.dense
        gate = None if ffn.gate is None else ffn.gate[:, idx].t()
        return gate, ffn.up[:, idx].t(), ffn.down[idx]

    def release(self) -> None:
        pass  # nothing derived


class FileFFNRows:
    """Rows of one layer's FFN in the file's blocks: gate_up [gate, up] (gated activations)
    or [up], each (ffn, hidden); down (hidden, ffn). The tensors are the file's own (views
    of the mapping), so holding this object costs nothing."""

    def __init__(self, gate_up: list[QTensor], down: QTensor, activation: str):
        if len(gate_up) != (2 if is_gated(activation) else 1):
            raise ValueError(f"activation {activation!r} takes "
                             f"{2 if is_gated(activation) else 1} gate/up tensors, "
                             f"got {len(gate_up)}")
        self.gate_up, self.down, self.activation = list(gate_up), down, activation
        self.gate = gate_up[0] if len(gate_up) == 2 else None
        self.up = gate_up[-1]
        self.ffn_size, self.hidden = self.up.shape
        self.dense = self  # runs dense on the blocks themselves (see __call__)
        self._down_nm: torch.Tensor | None = None

    def types(self) -> tuple[list[str], str]:
        """The file's types of gate/up and of down (what the GPU tier's formats follow)."""
        return [t.qtype_name for t in self.gate_up], self.down.qtype_name

    def neuron_rows(self, idx: torch.Tensor) -> Rows:
        """Float32 rows of neurons `idx`: gate/up dequantized from their own blocks only,
        down from the layer's neuron-major form (derived on first use)."""
        gate = None if self.gate is None else self.gate.dequantize_rows(idx)
        return gate, self.up.dequantize_rows(idx), self.down_nm().index_select(0, idx)

    def down_nm(self) -> torch.Tensor:
        """(ffn, hidden) float32: down's columns as rows. Made once per layer while it is
        split (hidden * ffn * 4 bytes, one layer at a time), until `release`."""
        if self._down_nm is None:
            self._down_nm = self.down.dequantize().t()
        return self._down_nm

    def release(self) -> None:
        """Drop the derived down: the split keeps copies of the rows it sliced."""
        self._down_nm = None

    @property
    def nbytes(self) -> int:
        """The file's bytes a dense pass reads."""
        return sum(t.nbytes for t in (*self.gate_up, self.down))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Every neuron, on the file's blocks: h (T, hidden) -> (T, hidden), the FFN that
        kernels/decoder_step.py runs for a layer nobody split."""
        gu = bm.block_matmul(h.float().contiguous(), self.gate_up)
        gate, up = (gu.split(self.ffn_size, dim=1) if self.gate is not None else (None, gu))
        return bm.block_matmul(activate(self.activation, gate, up).contiguous(), [self.down])


def as_rows(ffn) -> FloatFFNRows | FileFFNRows:
    """A row source for `ffn`: a FeedForward is wrapped; a source is returned as is."""
    return FloatFFNRows(ffn) if isinstance(ffn, FeedForward) else ffn
