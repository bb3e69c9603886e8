"""y = x @ W^T reading only the weight columns of inputs with |x_i| > threshold.

For y = W x, an input x_i at or below the threshold is dropped and the column W[:, i] it
would multiply is never read: the skip pays on any activation, GLU included, with no
predictor. The file stores W row-major (one row per output), where a column is spread over
every row's blocks, so each weight that runs this way is re-ordered once at load into
input-major tiles (`InputMajor`; csrc/input_major.h, kernels/tile_layout.py): per super-block
of the file's block inputs, every row's header bytes, then each input's column of quants (or
of F32/F16/BF16 values). The bytes are the file's (Q4_K stays 4.5 bits per weight), so nothing
is rounded again, and the same tiles run prefill (dense over every input).

Arithmetic (w = a * q + b per row and sub-block of inputs): the 4-, 5- and 6-bit types round
each row's kept x to int8 per file block (max|x| / 127, as the dense kernel, block_matmul,
rounds x; a dropped input is a 0, so the kept ones round as they would densely) and sum
xq_i * q_i exactly in integers, then y += dx * (a * sum + b * sum(xq)); Q8_0 and the float
types sum x_i * q_i in float, in input order. Every CPU path gives the same bits, and a row's
outputs do not depend on the other rows. `input_sparse_matmul_reference` is the plain version
(masked x, rounded as the kernel rounds it, against the dequantized weight, float64 sums)
that the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from gguf import GGMLQuantizationType as Q

from ember.models import quants
from ember.models.weights import QTensor

from . import block_matmul as bm
from . import cpu_extension
from . import tile_layout as tl

__all__ = ["InputMajor", "TILED_TYPES", "available", "dequantize_input_major",
           "input_sparse_matmul", "input_sparse_matmul_reference", "integer_type",
           "relayout", "relayout_reference", "tiled"]

TILED_TYPES = tuple(tl.FORMATS)  # the GGML types the tiles hold


@dataclass(frozen=True)
class InputMajor:
    """A weight (n, k) of GGML type `qtype` as input-major tiles: `packed` uint8 bytes."""

    packed: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def tiled(qtype: int) -> bool:
    """Whether weights of this GGML type can run input-sparse."""
    return int(qtype) in tl.FORMATS


def _module():
    module = cpu_extension.load()
    return module if module is not None and hasattr(module, "tile_relayout") else None


def available() -> bool:
    return _module() is not None


def _check_weight(w: QTensor) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"an input-major weight must be 2-D, got shape {tuple(w.shape)}")
    if not tiled(w.qtype):
        names = ", ".join(quants.type_name(t) for t in TILED_TYPES)
        raise ValueError(f"input-major tiles hold {names} weights, not "
                         f"{quants.type_name(w.qtype)}")
    return w.shape


def relayout(w: QTensor) -> InputMajor:
    """W (n, k) in its file blocks -> its tiles (C++; the reference without the extension)."""
    n, k = _check_weight(w)
    w = w.file_layout()  # the tiles are built from rows as the file has them
    module = _module()
    if module is None:
        return relayout_reference(w)
    packed = module.tile_relayout(w.raw.reshape(-1).contiguous(), int(w.qtype), n, k)
    return InputMajor(packed, int(w.qtype), (n, k))


def relayout_reference(w: QTensor) -> InputMajor:
    """The same tiles, built in PyTorch (kernels/tile_layout.py)."""
    n, k = _check_weight(w)
    w = w.file_layout()
    packed = tl.to_tiles(w.raw.reshape(-1), int(w.qtype), n, k)
    return InputMajor(packed, int(w.qtype), (n, k))


def dequantize_input_major(w: InputMajor) -> torch.Tensor:
    """The weight as the kernel sees it: (n, k) float32, the file's values bit for bit."""
    return tl.dequantize_tiles(w.packed, w.qtype, *w.shape)


def _check_x(x: torch.Tensor, weights: Sequence[InputMajor]) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu:
        raise ValueError("x must be a float32 (T, K) CPU tensor")
    for i, w in enumerate(weights):
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"input-major weight {i} has {w.shape[1]} inputs; x has "
                             f"{x.shape[1]} columns")


def input_sparse_matmul(x: torch.Tensor, weights: Sequence[InputMajor],
                        threshold: float | None = None,
                        stats: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) float32 -> (T, sum N_i), the weights' outputs side by side, reading only the
    columns of inputs with |x| > threshold (every input when threshold is None). `stats`, an
    int64 tensor of 2, accumulates [inputs kept, inputs seen] over calls."""
    _check_x(x, weights)
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    module = _module()
    if module is None:
        if stats is not None:
            seen = x.numel()
            kept = seen if threshold is None else int((x.abs() > threshold).sum())
            stats += torch.tensor([kept, seen])
        return input_sparse_matmul_reference(x, weights, threshold)
    return module.input_sparse_matmul(
        x.contiguous(), [w.packed for w in weights], [w.qtype for w in weights],
        [w.shape[0] for w in weights], -1.0 if threshold is None else float(threshold), stats)


def integer_type(qtype: int) -> bool:
    """Whether the kernel rounds x to int8 for this type (csrc/input_major.h, int_type)."""
    return tiled(qtype) and int(qtype) not in tl.FLOATS and int(qtype) != int(Q.Q8_0)


def _as_the_kernel_reads(xm: torch.Tensor, qtype: int) -> torch.Tensor:
    """Masked x in float64, rounded to int8 per file block where the kernel rounds it."""
    if not integer_type(qtype):
        return xm.double()
    block = tl.FORMATS[int(qtype)].qk
    q, d = bm.quantize_activations_reference(xm, block)
    return (q.double() * d.double()).reshape(xm.shape)


def input_sparse_matmul_reference(x: torch.Tensor, weights: Sequence[InputMajor],
                                  threshold: float | None = None) -> torch.Tensor:
    """Masked x (inputs at or below the threshold set to 0; rounded to int8 per block as the
    kernel rounds it, for the 4-6 bit types) against the dequantized weights, summed in
    float64 -> float32."""
    _check_x(x, weights)
    xm = x if threshold is None else torch.where(x.abs() > threshold, x, torch.zeros_like(x))
    outs = [_as_the_kernel_reads(xm, w.qtype) @ dequantize_input_major(w).double().t()
            for w in weights]
    if not outs:
        return x.new_zeros(x.shape[0], 0)
    return torch.cat(outs, 1).float()
