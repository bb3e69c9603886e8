"""Vectorized PyTorch (de)quantization of GGML tensor data.

GGUF files store each weight tensor as a run of fixed-size *blocks*: a block
holds `block_size` consecutive elements of one row (the last, contiguous torch
dimension) in `type_size` bytes.  Rows never share a block, so a row of
`n_cols` elements takes `n_cols // block_size * type_size` bytes and a whole
tensor is just its rows back to back.

This module turns those bytes into float32 tensors at model load time
(`dequantize`); `quantize.py` writes them for tiny test models.  Every
block type has one small kernel that works on all blocks at once: the raw
bytes are viewed as a `[n_blocks, type_size]` uint8 matrix, the fields are
sliced out as columns, bits are unpacked with shifts and masks on uint8
tensors, and the scales are applied in float32.

The per-type kernels, with the block layouts and which bits belong to which
element, are in `block_decoders.py`.
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .block_decoders import DEQUANT
from .support.errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_TYPES",
    "block_info",
    "row_nbytes",
    "dequantize",
    "decode_blocks",
]

T = GGMLQuantizationType

# Elements decoded per kernel call.  Chunking bounds the memory of the uint8
# intermediates (a 262144 x 640 embedding would otherwise need hundreds of MB
# of them); below ~2**18 the per-op overhead of eager torch starts to dominate.
_CHUNK_ELEMENTS = 1 << 20


def type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"#{int(qtype)}"


SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in DEQUANT)


def _supported_names() -> str:
    return ", ".join(T(t).name for t in sorted(SUPPORTED_TYPES))


# --------------------------------------------------------------------------
# Public size helpers
# --------------------------------------------------------------------------

def block_info(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type."""
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            "<tensor data>",
            f"quant type {type_name(qtype)} is not supported; supported: {_supported_names()}",
        )
    return GGML_QUANT_SIZES[T(qtype)]


def row_nbytes(qtype: int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements.

    Pure arithmetic: works for every type gguf knows the block size of (also
    ones `dequantize` cannot handle, so a loader can still lay out a file).
    Raises ValueError for an unknown type id or a partial block.
    """
    try:
        block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGML quant type id {int(qtype)}") from None
    if n_cols < 0 or n_cols % block_size:
        raise ValueError(
            f"row of {n_cols} elements is not a whole number of "
            f"{type_name(qtype)} blocks ({block_size} elements each)"
        )
    return n_cols // block_size * type_size


def check_shape(qtype: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """-> (numel, block_size, type_size); ValueError if rows would split a block."""
    block_size, type_size = block_info(qtype)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    n_cols = shape[-1] if shape else 1
    if n_cols % block_size:
        raise ValueError(
            f"last dimension {n_cols} of shape {shape} is not a multiple of the "
            f"{type_name(qtype)} block size {block_size}"
        )
    return math.prod(shape), block_size, type_size


# --------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------

def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a tensor's raw GGML bytes into a float32 tensor of `shape`.

    `raw` is a 1-D uint8 tensor holding exactly the tensor's bytes (it may be a
    read-only memmap view; it is never written).  `shape` is in torch order:
    the last dimension is the one blocks run along.  The result is a new
    tensor that owns its memory (also for F32), or `out` if given: a
    contiguous float32 CPU tensor of `shape` (e.g. pinned memory or a slice of
    a larger buffer) that is filled and returned.

    Raises UnsupportedModelError for a type not in SUPPORTED_TYPES and
    ValueError when `raw` or `out` do not fit `shape`.
    """
    shape = tuple(int(s) for s in shape)
    numel, block_size, type_size = check_shape(qtype, shape)
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(f"raw data must be a 1-D uint8 tensor, got {raw.dtype} of shape {tuple(raw.shape)}")
    n_blocks = numel // block_size
    expected = n_blocks * type_size
    if raw.numel() != expected:
        raise ValueError(
            f"{type_name(qtype)} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}"
        )

    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif (out.dtype != torch.float32 or tuple(out.shape) != shape or out.device.type != "cpu"
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {shape}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if n_blocks == 0:
        return out
    raw = raw.contiguous()
    if block_size == 1 and (raw.data_ptr() % type_size or raw.storage_offset() % type_size):
        raw = raw.clone()  # F32/F16/BF16 kernels view the bytes as a wider dtype: align them
    blocks = raw.view(n_blocks, type_size)
    flat = out.view(n_blocks, block_size)
    kernel = DEQUANT[int(qtype)]
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        kernel(blocks[start:start + step], flat[start:start + step])
    return out


def decode_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Whole blocks (n, type_size) uint8, on any device -> their values (n, block_size)
    float32 on that device, bit for bit what `dequantize` gives (the same per-type kernels:
    torch ops only, so a GPU decodes blocks it holds without a host round trip)."""
    block_size, type_size = block_info(qtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"{type_name(qtype)} blocks must be (n, {type_size}) uint8, got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32, device=blocks.device)
    blocks = blocks.contiguous()
    if block_size == 1 and blocks.storage_offset() % type_size:
        blocks = blocks.clone()  # F32/F16/BF16 view the bytes as a wider dtype: align them
    if blocks.shape[0]:
        DEQUANT[int(qtype)](blocks, out)
    return out
