"""x @ W^T with W in GGML Q8_0 blocks, each weight row read once for all rows of x.

The reference dequantizes W to float32 and multiplies; the C++ kernel (csrc/q8_0_matmul.cpp)
reads the 34-byte blocks directly: a quarter of the float32 bytes, which is what decides the
speed of a memory-bound LM head. Both compute the same products d * q_i; only the order of
the sums differs (differences ~1e-6 relative).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from ember.models import quants

from . import cpu_extension

Q8_0 = int(GGMLQuantizationType.Q8_0)


def q8_0_rows(raw: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """The raw bytes of an (n_rows, n_cols) Q8_0 tensor as (n_rows, row_bytes) uint8."""
    return raw.view(n_rows, quants.row_nbytes(Q8_0, n_cols))


def q8_0_matmul_reference(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32, rows (N, row_bytes) -> (T, N)."""
    n, k = rows.shape[0], x.shape[1]
    w = quants.dequantize(rows.reshape(-1), Q8_0, (n, k))
    return x @ w.t()


def q8_0_matmul(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32 on the CPU, rows (N, row_bytes) uint8 -> (T, N) float32."""
    module = cpu_extension.load()
    if module is None or not hasattr(module, "q8_0_matmul"):
        return q8_0_matmul_reference(x, rows)
    return module.q8_0_matmul(x.contiguous(), rows)


def available() -> bool:
    module = cpu_extension.load()
    return module is not None and hasattr(module, "q8_0_matmul")
