"""x @ W^T with each W read straight from its GGML blocks, for the types real GGUF files use.

The weights stay as the file stores them (no float copy, no requantized copy). The C++ kernel
(csrc/block_matmul.cpp) quantizes x per row the way llama.cpp's CPU backend does: to int8 per
32 values (Q8_0-style: scale max|x|/127, round half to even) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, per
256 values (Q8_K-style) for Q4_K/Q5_K/Q6_K; F16/BF16/F32 weights use x in float32. Each block's
dot product is exact integer arithmetic, then the block's scales in float32.

`block_matmul_reference` does the same in PyTorch: x quantized identically, the weights
dequantized by `models.quants.dequantize` (GGML's own values, bit for bit), the products summed
in float64. Kernel and reference differ only by float32 rounding (~1e-6 of the output's scale);
against the float matmul the activation rounding adds ~0.2-0.5% (x's 8-bit grid, as
llama.cpp). Every row of the result depends only on its own row of x, bit for bit, whatever T
is (speculative verification relies on this).

Several weights sharing K go in one call (q/k/v, gate/up): x is quantized once and the outputs
come side by side. The instruction-set path ("avx512", "avx2" or "portable") is chosen at
first use from the CPU, or by EMBER_CPU_PATH; `set_cpu_path` switches it (tests run every
path). On AVX2 and AVX-512, tiles of 16 rows of x (prefill) take a separate kernel for the
K-quants, with the very same arithmetic per output. Speeds: csrc/block_matmul.cpp (top), `python -m bench.block_matmul_speed`.

A K-quant weight in row groups (`QTensor.in_row_groups`; an engine puts a RAM copy's matrices
in them where the path reads them in place, `reads_row_groups`) gives the same bits: the
AVX-512 kernels read the groups in place, the other paths take each tile back to rows first.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

import torch
from gguf import GGMLQuantizationType as Q

from ember.models import quants

from . import cpu_extension

if TYPE_CHECKING:
    from ember.models.weights import QTensor

__all__ = ["NATIVE_TYPES", "available", "block_matmul", "block_matmul_reference", "cpu_path",
           "cpu_paths", "dequantize_row", "dequantize_row_reference", "reads_row_groups",
           "set_cpu_path", "supports"]

_FLOAT_TYPES = frozenset(int(t) for t in (Q.F32, Q.F16, Q.BF16))
_SMALL_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
_K_TYPES = frozenset(int(t) for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K))
NATIVE_TYPES: frozenset[int] = _FLOAT_TYPES | _SMALL_TYPES | _K_TYPES
_PATHS = ("portable", "avx2", "avx512")  # every path a build can have, in order of preference
X_LEVELS = 127  # x is rounded to int8 per block: q = round(x * 127 / max|x|), d = max|x| / 127
_REF_CHUNK = 1 << 22  # weight values dequantized at a time by the reference


def supports(qtype: int) -> bool:
    return int(qtype) in NATIVE_TYPES


def _module():
    module = cpu_extension.load()
    return module if module is not None and hasattr(module, "block_matmul") else None


def available() -> bool:
    return _module() is not None


def cpu_path() -> str:
    """"avx512", "avx2" or "portable" (the path the kernel runs), or "reference" without the extension.

    Raises ValueError if EMBER_CPU_PATH names a path that is unknown or that this CPU lacks."""
    module = _module()
    return "reference" if module is None else module.cpu_path()


def set_cpu_path(name: str) -> None:
    """Use path `name` from now on (this process); ValueError naming the choices if unusable."""
    module = _module()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are unavailable "
                           f"({cpu_extension.unavailable_reason()}); no CPU path to choose")
    module.set_cpu_path(name)


def cpu_paths() -> tuple[str, ...]:
    """The paths this build and CPU can run (`bench decode --json` reports them; tests run each)."""
    module = _module()
    if module is None:
        return ()
    current, usable = module.cpu_path(), []
    for name in _PATHS:
        try:
            module.set_cpu_path(name)
            usable.append(name)
        except ValueError:
            pass
    module.set_cpu_path(current)
    return tuple(usable)


_QUANT_BLOCKS = {t: quants.block_info(t) for t in NATIVE_TYPES}  # qtype -> (values, bytes) per block


def _check(x: torch.Tensor, weights: Sequence[QTensor]) -> list[tuple[int, int, int]]:
    """ValueError unless x and the weights fit; -> (qtype, N, row bytes) per weight.

    Runs on every call (a few hundred per decoded token), so only cheap checks."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 \
            or not x.is_cpu:
        what = (f"{x.dtype} of shape {tuple(x.shape)} on {x.device}"
                if isinstance(x, torch.Tensor) else type(x).__name__)
        raise ValueError(f"x must be a float32 (T, K) CPU tensor, got {what}")
    k = x.shape[1]
    out = []
    for i, w in enumerate(weights):
        qtype = int(w.qtype)
        blocks = _QUANT_BLOCKS.get(qtype)
        if blocks is None:
            names = ", ".join(quants.type_name(t) for t in sorted(NATIVE_TYPES))
            raise ValueError(f"weight {i}: GGML type {quants.type_name(qtype)} is not read "
                             f"natively; supported: {names}")
        shape = w.shape
        if len(shape) != 2 or shape[1] != k:
            raise ValueError(f"weight {i} has shape {tuple(shape)}; x has {k} columns, so "
                             f"(N, {k}) was expected")
        values, nbytes = blocks
        if k % values:
            raise ValueError(f"x has {k} columns, not a whole number of "
                             f"{quants.type_name(qtype)} blocks ({values} values each)")
        row_bytes = k // values * nbytes
        raw = w.raw
        if raw.dtype != torch.uint8 or raw.numel() != shape[0] * row_bytes:
            raise ValueError(f"weight {i} ({quants.type_name(qtype)} {tuple(shape)}) holds "
                             f"{raw.numel()} {raw.dtype} values, expected "
                             f"{shape[0] * row_bytes} bytes")
        out.append((qtype, shape[0], row_bytes))
    return out


def block_matmul(x: torch.Tensor, weights: Sequence[QTensor]) -> torch.Tensor:
    """x (T, K) float32 CPU, weights each (N_i, K) -> (T, sum N_i) float32, side by side.

    Raises ValueError for a weight that does not fit x or a type not in NATIVE_TYPES.
    """
    meta = _check(x, weights)
    module = _module()
    if module is None:
        return block_matmul_reference(x, weights)
    # The raw bytes go as they are (1-D): the kernel takes N from them, no view per call; row
    # groups as (N / 16, 16, row bytes), which says what they are.
    return module.block_matmul(x.contiguous(),
                               [w.rows() if w.grouped else w.raw.contiguous() for w in weights],
                               [q for q, _, _ in meta])


def reads_row_groups() -> bool:
    """Whether the current path reads K-quant row groups in place for one token (AVX-512):
    where it does not, row groups would only cost a reordering per tile. EMBER_ROW_GROUPS=0
    says no whatever the path (to measure the file's layout against them)."""
    return os.environ.get("EMBER_ROW_GROUPS", "1") != "0" and cpu_path() == "avx512"


def quantize_activations_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) float32 -> (q (T, K/block, block) integer-valued float32, d (T, K/block, 1)).

    Per block d = max|x| / 127 and q = round-half-even(x * (127 / max|x|)) (float32, one
    division per block, as llama.cpp); a block whose max is 0, or so small that 127 / max
    overflows, has d = 0 and q = 0.
    """
    t, k = x.shape
    xb = x.reshape(t, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    levels = torch.full_like(amax, X_LEVELS)
    d, inv = amax / levels, levels / amax  # float32 divisions (`127 / t` would be a reciprocal)
    ok = (d > 0) & torch.isfinite(inv)
    q = torch.where(ok, torch.round(xb * inv), torch.zeros_like(xb)).clamp_(-X_LEVELS, X_LEVELS)
    return q, torch.where(ok, d, torch.zeros_like(d))


def block_matmul_reference(x: torch.Tensor, weights: Sequence[QTensor]) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: x quantized as the kernel does, the weights
    dequantized by `quants.dequantize`, the products summed in float64 -> float32."""
    _check(x, weights)
    t, k = x.shape
    x_hat: dict[int, torch.Tensor] = {}  # block size -> x as the kernel sees it, in float64
    outs = []
    for w in weights:
        qtype = int(w.qtype)
        block = 0 if qtype in _FLOAT_TYPES else 256 if qtype in _K_TYPES else 32
        if block not in x_hat:
            if block == 0:
                x_hat[block] = x.double()
            else:  # q * d is exact in float64 (7 + 24 significant bits)
                q, d = quantize_activations_reference(x.float(), block)
                x_hat[block] = (q.double() * d.double()).reshape(t, k)
        n = w.shape[0]
        rb = quants.row_nbytes(qtype, k)
        raw = w.file_layout().raw.reshape(-1)
        step = max(1, _REF_CHUNK // max(1, k))
        parts = []
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            wf = quants.dequantize(raw[r0 * rb:r1 * rb], qtype, (r1 - r0, k))
            parts.append(x_hat[block] @ wf.double().t())
        outs.append(torch.cat(parts, 1) if parts else x.new_zeros(t, 0, dtype=torch.float64))
    if not outs:
        return x.new_zeros(t, 0)
    return torch.cat(outs, 1).float()


def _check_row(t: QTensor, index: int) -> tuple[int, int, int]:
    """(qtype, n, k) of a 2-D tensor of a NATIVE type whose row `index` exists."""
    qtype = int(t.qtype)
    if qtype not in NATIVE_TYPES:
        raise ValueError(f"GGML type {quants.type_name(qtype)} is not read natively")
    n, k = t.shape
    if not 0 <= index < n:
        raise IndexError(f"row {index} outside {n} rows")
    return qtype, n, k


def dequantize_row_reference(t: QTensor, index: int) -> torch.Tensor:
    """Row `index` by `quants.dequantize` of that row's bytes: (1, K) float32."""
    _check_row(t, index)
    return t.select_rows(torch.tensor([index])).dequantize()


def dequantize_row(t: QTensor, index: int) -> torch.Tensor:
    """Row `index` of a 2-D tensor of a NATIVE type as (1, K) float32, bit-identical to
    `dequantize_row_reference` (e.g. a decoded token's embedding)."""
    qtype, n, k = _check_row(t, index)
    module = _module()
    if module is None:
        return dequantize_row_reference(t, index)
    rows = t.rows() if t.grouped else t.raw.contiguous().view(n, quants.row_nbytes(qtype, k))
    return module.dequantize_row(rows, qtype, int(index))
