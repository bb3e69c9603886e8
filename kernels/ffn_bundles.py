"""Neuron bundles: the memory layout of `SparseFFNWeights` (one neuron = one contiguous bundle).

A neuron's weights are its gate row, up row and down row (down_nm: one column of the usual
(hidden, ffn) down matrix), each `hidden` long. The sparse kernel reads whole neurons in a
random order, so they are stored back to back, one bundle per neuron, padded to a cache line:

    fp32: [gate | up | down]                     round_up(3 * hidden, 16) floats
    int8: [gate | up | down | 3 fp32 scales]     scales at byte round_up(3 * hidden, 16),
                                                 bundle = round_up(that + 16, 64) bytes

Plain MLP activations have no gate row (two rows, two scales). A sparse read is then one
sequential stream per neuron (its scales included), instead of three streams in three
matrices plus three scale lookups. The buffer is 2 MiB-aligned and advised for transparent
huge pages where Linux allows: a random 12 KiB read touches 3-4 small pages, each a TLB miss.

int8 rows are symmetric per row (`quantize_rows_int8`): w[i, :] ~= q[i, :] * scale[i].

Must match `layout_of` in csrc/sparse_ffn.cpp.
"""

from __future__ import annotations

import torch

from .page_advice import empty_on_huge_pages


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def bundle_layout(hidden: int, gated: bool, dtype: str) -> tuple[int, int]:
    """(bundle length in elements of the weight dtype, byte offset of the scales or -1)."""
    nrows = 3 if gated else 2
    if dtype == "fp32":
        return _round_up(nrows * hidden, 16), -1
    scales = _round_up(nrows * hidden, 16)
    return _round_up(scales + 16, 64), scales


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


def empty_bundles(ffn: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised (ffn, length) buffer, on huge pages when big (page_advice.py)."""
    return empty_on_huge_pages((ffn, length), dtype)


def pack_rows(rows: list[torch.Tensor], scales: list[torch.Tensor] | None, dtype: str) -> torch.Tensor:
    """Bundles from rows [gate,] up, down_nm, each (ffn, hidden), fp32 (any float dtype or
    strides) or int8 with their (ffn,) fp32 scales."""
    ffn, hidden = rows[-1].shape
    length, scale_off = bundle_layout(hidden, len(rows) == 3, dtype)
    packed = empty_bundles(ffn, length, torch.float32 if dtype == "fp32" else torch.int8)
    for j, r in enumerate(rows):
        packed[:, j * hidden:(j + 1) * hidden].copy_(r.detach())
    packed[:, len(rows) * hidden:].zero_()  # padding (never read) and the scale slots
    if scales is not None:
        scale_view(packed, scale_off, len(rows)).copy_(torch.stack(scales, dim=1))
    return packed


def scale_view(packed: torch.Tensor, scale_off: int, nrows: int) -> torch.Tensor:
    """The int8 bundles' scales as an fp32 (ffn, nrows) view (column j: row j's scales)."""
    return packed[:, scale_off:scale_off + 4 * nrows].view(torch.float32)
