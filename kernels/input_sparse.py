"""y = x @ W^T reading only the weight columns of inputs with |x_i| > threshold.

For y = W x, an input x_i at or below the threshold is dropped and the column W[:, i] it
would multiply is never read: the skip pays on any activation, GLU included, with no
predictor. The file stores W row-major (one row per output), where a column is spread over
every row's blocks, so each weight that runs this way is re-laid out once at load,
input-major (`InputMajor`, csrc/input_major.h): per chunk of 256 outputs, per input column,
that column's outputs in GGML 32-value blocks (Q4_0, Q5_0 or Q8_0). The re-layout rounds the
file's values a second time, to a grid of about the file's bits (`layout_type`); its error is
measured (`relayout_error`) and reported by `ember bench sparsity`. The same layout runs
prefill (dense over every input), so a matmul that uses it reads the file's copy no more.

Arithmetic: each output is acc = fma(x_i * d, q - offset, acc) over the kept inputs in order
(d the block's scale): every CPU path gives the same bits, a row's outputs do not depend on the
other rows, and a thresholded row gives exactly its masked dense product's bits.
`input_sparse_matmul_reference` is the plain version (masked x against the dequantized layout, float64
sums) that the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from gguf import GGMLQuantizationType as Q

from ember.models import quants
from ember.models.quantize import quantize
from ember.models.weights import QTensor

from . import block_matmul as bm
from . import cpu_extension

__all__ = ["CHUNK", "InputMajor", "available", "dequantize_input_major", "input_sparse_matmul",
           "input_sparse_matmul_reference", "layout_type", "relayout", "relayout_error",
           "relayout_reference"]

CHUNK = 256  # outputs per chunk (csrc/input_major.h)
BLOCK = 32
IM_TYPES = (int(Q.Q4_0), int(Q.Q5_0), int(Q.Q8_0))
_IM_BYTES = {int(Q.Q4_0): 18, int(Q.Q5_0): 22, int(Q.Q8_0): 34}
# The file's type -> the input-major blocks of about as many bits (4.5 / 5.5 / 8.5 per
# weight). Q6_K and the float types take Q8_0 (more bytes than Q6_K's 6.56 bits: a dense
# pass over them reads 30% more, which `ember bench sparsity` counts).
_LAYOUT = {int(Q.Q4_0): int(Q.Q4_0), int(Q.Q4_K): int(Q.Q4_0),
           int(Q.Q4_1): int(Q.Q5_0), int(Q.Q5_0): int(Q.Q5_0), int(Q.Q5_1): int(Q.Q5_0),
           int(Q.Q5_K): int(Q.Q5_0)}


@dataclass(frozen=True)
class InputMajor:
    """A weight (n, k) in the input-major layout: `packed` uint8 bytes, blocks of `qtype`."""

    packed: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def layout_type(qtype: int) -> int:
    """The input-major block type for a weight stored as `qtype`."""
    return _LAYOUT.get(int(qtype), int(Q.Q8_0))


def _module():
    module = cpu_extension.load()
    return module if module is not None and hasattr(module, "input_sparse_matmul") else None


def available() -> bool:
    return _module() is not None


def _check_layout(w: QTensor, im_type: int) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"an input-major weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    if n % BLOCK:
        raise ValueError(f"a weight with {n} outputs cannot be laid out input-major: the "
                         f"outputs must be whole blocks of {BLOCK}")
    if int(im_type) not in IM_TYPES:
        raise ValueError(f"input-major blocks are Q4_0, Q5_0 or Q8_0, not "
                         f"{quants.type_name(im_type)}")
    if not bm.supports(w.qtype):
        raise ValueError(f"GGML type {quants.type_name(w.qtype)} is not read natively")
    return n, k


def relayout(w: QTensor, im_type: int | None = None) -> InputMajor:
    """W (n, k) in its file blocks -> InputMajor (C++; the reference without the extension)."""
    im_type = layout_type(w.qtype) if im_type is None else int(im_type)
    n, k = _check_layout(w, im_type)
    module = _module()
    if module is None:
        return relayout_reference(w, im_type)
    packed = module.im_relayout(w.raw.contiguous(), int(w.qtype), n, k, im_type)
    return InputMajor(packed, im_type, (n, k))


def relayout_reference(w: QTensor, im_type: int | None = None) -> InputMajor:
    """The re-layout in PyTorch: dequantize, then each chunk's transpose quantized by
    `models.quantize` (the kernel's quantizer follows the same rules, bit for bit)."""
    im_type = layout_type(w.qtype) if im_type is None else int(im_type)
    n, k = _check_layout(w, im_type)
    dense = w.dequantize()
    parts = [quantize(dense[c:c + CHUNK].t().contiguous(), im_type).reshape(-1)
             for c in range(0, n, CHUNK)]
    return InputMajor(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8),
                      im_type, (n, k))


def dequantize_input_major(w: InputMajor) -> torch.Tensor:
    """The weight as the kernel sees it: (n, k) float32."""
    n, k = w.shape
    out = torch.empty(n, k)
    per_block, offset = _IM_BYTES[w.qtype], 0
    for c in range(0, n, CHUNK):
        width = min(CHUNK, n - c)
        size = k * width // BLOCK * per_block
        out[c:c + width] = quants.dequantize(w.packed[offset:offset + size], w.qtype,
                                             (k, width)).t()
        offset += size
    return out


def relayout_error(w: QTensor, im: InputMajor) -> float:
    """RMS of (layout - file values) over RMS of the file values: the re-layout's rounding."""
    dense = w.dequantize()
    diff = dequantize_input_major(im) - dense
    return float(diff.pow(2).mean().sqrt() / dense.pow(2).mean().sqrt().clamp_min(1e-30))


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


def input_sparse_matmul_reference(x: torch.Tensor, weights: Sequence[InputMajor],
                           threshold: float | None = None) -> torch.Tensor:
    """Masked x (inputs at or below the threshold set to 0) against the dequantized layout,
    summed in float64 -> float32."""
    _check_x(x, weights)
    xm = x if threshold is None else torch.where(x.abs() > threshold, x, torch.zeros_like(x))
    outs = [xm.double() @ dequantize_input_major(w).double().t() for w in weights]
    if not outs:
        return x.new_zeros(x.shape[0], 0)
    return torch.cat(outs, 1).float()
