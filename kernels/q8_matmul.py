"""x @ W^T with W in GGML Q8_0 blocks, each weight row read once for all rows of x.

The runtime multiplies every GGML block type with `block_matmul`; this module keeps
`q8_0_quantize` (at load, FileBlocksModel turns tensors of a type block_matmul does not read
into Q8_0) and the first
Q8_0 kernel, which `bench/block_matmul_speed.py` measures against `block_matmul`.

The C++ kernel (csrc/q8_0_matmul.cpp) reads the 34-byte blocks directly: a quarter of the
float32 bytes, which is what decides the speed of memory-bound decoding. It rounds x to int16
per 32-element block first (scale max|x|/32767), so each block's dot product is exact integer
arithmetic. The reference does the same rounding in PyTorch, then multiplies in float64;
the two differ only by float32 rounding (~1e-7 relative). Against plain float32 `x @ w.T`
the activation rounding adds ~1e-5 relative, far below the weights' 8-bit grid.

Every row of the result depends only on its own row of x (bit for bit, whatever T is).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from ember.models import quants
from ember.models.quantize import quantize

from . import cpu_extension

Q8_0 = int(GGMLQuantizationType.Q8_0)
QUANT_BLOCK = 32  # values per Q8_0 block (and per activation scale)
X_LEVELS = 32767  # activations are rounded to int16: q = round(x / s), s = max|x| / 32767


def q8_0_rows(raw: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """The raw bytes of an (n_rows, n_cols) Q8_0 tensor as (n_rows, row_bytes) uint8."""
    return raw.view(n_rows, quants.row_nbytes(Q8_0, n_cols))


def _quantize_input(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % QUANT_BLOCK:
        raise ValueError(f"Q8_0 rows need a 2-D weight with a multiple of {QUANT_BLOCK} "
                         f"columns, got {tuple(w.shape)}")
    return w.detach().to("cpu", torch.float32).contiguous()


def q8_0_quantize_reference(w: torch.Tensor) -> torch.Tensor:
    """`q8_0_quantize` by models.quantize (GGML's own rounding, in PyTorch)."""
    w = _quantize_input(w)
    return q8_0_rows(quantize(w, Q8_0), *w.shape)


def q8_0_quantize(w: torch.Tensor) -> torch.Tensor:
    """float (N, K) -> (N, row_bytes) Q8_0 rows (round to nearest, as GGML). K % 32 == 0."""
    module = cpu_extension.load()
    if module is None or not hasattr(module, "q8_0_quantize"):
        return q8_0_quantize_reference(w)
    return module.q8_0_quantize(_quantize_input(w))  # the same bytes, ~50x faster


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) float32 -> (q (T, K/32, 32) integer-valued float32, s (T, K/32, 1)), x ~= q*s.

    Round half to even, like the kernel; an all-zero block gets s = 0 and q = 0.
    """
    t, k = x.shape
    xb = x.reshape(t, k // QUANT_BLOCK, QUANT_BLOCK)
    s = xb.abs().amax(-1, keepdim=True) / X_LEVELS
    q = torch.where(s == 0, torch.zeros_like(xb), torch.round(xb / s))
    return q, s


def q8_0_matmul_reference(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32, rows (N, row_bytes) -> (T, N): the kernel's arithmetic in PyTorch."""
    n, k = rows.shape[0], x.shape[1]
    w = quants.dequantize(rows.reshape(-1), Q8_0, (n, k))
    q, s = quantize_activations_reference(x.float())
    x_hat = (q * s).reshape(x.shape)  # exact: q has at most 16 significant bits
    return (x_hat.double() @ w.double().t()).float()


def q8_0_matmul(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32 on the CPU, rows (N, row_bytes) Q8_0 blocks -> (T, N) float32."""
    module = cpu_extension.load()
    if module is None:
        return q8_0_matmul_reference(x, rows)
    return module.q8_0_matmul(x.contiguous(), rows)


def available() -> bool:
    module = cpu_extension.load()
    return module is not None and hasattr(module, "q8_0_matmul")
