"""Weights held on the GPU tier in a compact type: one table of formats, one matmul each.

A `TierLinear` is y (T, N) = x (T, K) @ W^T for a weight W (N, K) stored as:

    int4  4-bit codes, a (scale, zero) pair per 32 values along K, bf16:
          w = (q - 8) * scale + zero, q in 0..15 (PyTorch's int4 weight-only matmul,
          `_weight_int4pack_mm` on CUDA sm80+, `_weight_int4pack_mm_for_cpu` on the CPU: the
          same codes and scales, each device's own tile layout, N * K / 2 bytes either way).
          Groups of 32 are the file's own Q4_0/Q4_K sub-block size.
    int8  one int8 code per value and one scale per output row: w = q * scale
          (`_weight_int8pack_mm` on CUDA where the build has it, else a dequantizing
          matmul: the CPU op of torch 2.13 segfaults on 2+ rows at K = 40, 70, ...).
    fp16 / bf16 / fp32   the values themselves.

Every format states its exact bytes (`linear_bytes`, what the memory plan charges) and is
tested against `dequantize` (the float W its codes stand for). Nothing here imports a GPU
library: the tensors' device decides where it runs, and the only per-device difference is
which aten op packs and multiplies int4 tiles (the same codes go in on both), chosen in one
place (`int4_ops`). The file's own blocks are a tier format too (kernels/tier_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # values per (scale, zero) pair: a Q4_0 block, a Q4_K sub-block
FORMATS = ("int4", "int8", "fp16", "bf16", "fp32")
_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_WIDTH = {"int4": 0, "int8": 1, "fp16": 2, "bf16": 2, "fp32": 3}  # for picking the wider


def wider(a: str, b: str) -> str:
    """The format that loses less of the two (for tensors fused into one matmul)."""
    return a if _WIDTH[a] >= _WIDTH[b] else b


def linear_bytes(fmt: str, n_out: int, n_in: int, half: torch.dtype = torch.bfloat16) -> int:
    """Exact bytes of an (n_out, n_in) weight held in `fmt` (codes plus scales)."""
    if fmt == "int4":
        return n_out * n_in // 2 + (n_in // INT4_GROUP) * n_out * 2 * 2
    if fmt == "int8":
        return n_out * n_in + n_out * half.itemsize
    return n_out * n_in * _FLOAT[fmt].itemsize


def int4_fits(n_out: int, n_in: int) -> bool:
    """The int4 tile layouts need K in whole 32-value groups (and innerKTiles * 16) and N in
    multiples of 16 (the CPU's; CUDA's are 8)."""
    return n_in > 0 and n_in % INT4_GROUP == 0 and n_out % 16 == 0


def _inner_k_tiles(n_in: int) -> int:
    return next(t for t in (8, 4, 2) if n_in % (16 * t) == 0)


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether aten `op` has a kernel for `device`'s backend in this PyTorch build."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except RuntimeError:
        return False


def int8_op_usable(device: torch.device) -> bool:
    """The aten int8 weight-only matmul on CUDA builds that have it; never on the CPU, where
    torch 2.13's kernel crashes on multi-row inputs of many widths (tests call it on a
    width it takes, to keep its layout checked)."""
    return device.type == "cuda" and has_kernel("_weight_int8pack_mm", device)


# -- reference quantizers (pure torch, float32) -----------------------------------------------

def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP):
    """w (N, K) -> codes (N, K) int32 in 0..15, scale and zero (N, K/group) bf16, with
    w ~ (q - 8) * scale + zero: each group's min..max over 15 steps, codes rounded against
    the stored (bf16) scale and zero so their rounding is absorbed where it can be."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    base = zero.float() - 8 * scale.float()  # what code 0 stands for
    q = torch.round((g - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.to(torch.int32).reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    s = scale.float().repeat_interleave(group, 1)
    return (q.float() - 8) * s + zero.float().repeat_interleave(group, 1)


def quantize_int8(w: torch.Tensor, half: torch.dtype):
    """w (N, K) -> codes (N, K) int8 and per-row scales (N,) in `half`: w ~ q * scale."""
    scale = (w.float().abs().amax(1) / 127).clamp_min(1e-12).to(half)
    q = torch.round(w.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius): the conversion error a format costs."""
    norm = float(exact.float().norm())
    return float((approx.float() - exact.float()).norm()) / norm if norm > 0 else 0.0


def conversion_error(w: torch.Tensor, fmt: str, half: torch.dtype = torch.bfloat16) -> float:
    """What storing rows w (N, K) in `fmt` loses: the relative error `TierLinear.pack`
    records, without packing (for estimates from a sample of rows)."""
    w = w.float()
    if fmt == "int4":
        return relative_error(dequantize_int4(*quantize_int4(w)), w)
    if fmt == "int8":
        q, scale = quantize_int8(w, half)
        return relative_error(q.float() * scale.float()[:, None], w)
    return relative_error(w.to(_FLOAT[fmt]), w)


# -- the tier's weights ---------------------------------------------------------------------

@dataclass(frozen=True)
class TierLinear:
    """W (N, K) on the tier in `fmt`; `tensors` as the format keeps them (see module doc).

    `error`: the relative (Frobenius) error of the stored W against the rows it was made
    from, measured at packing (0 for fp32)."""

    fmt: str
    shape: tuple[int, int]
    tensors: dict
    compute: torch.dtype  # activations' type in the matmul; results come back in it
    error: float
    fast_int8: bool = False  # int8 through _weight_int8pack_mm (see int8_op_usable)

    @classmethod
    def pack(cls, w: torch.Tensor, fmt: str, device: torch.device | str = "cpu",
             half: torch.dtype = torch.bfloat16, fast_int8: bool | None = None) -> "TierLinear":
        """From float rows w (N, K) on the host. `half`: the 16-bit type int8 scales and
        activations use (bf16 where the device does it well, fp16 otherwise). fast_int8
        None: the aten int8 op where `int8_op_usable`."""
        device = torch.device(device)
        if fast_int8 is None:
            fast_int8 = int8_op_usable(device)
        w = w.float().contiguous()
        n, k = w.shape
        if fmt == "int4":
            if not int4_fits(n, k):
                raise ValueError(f"int4 needs K a multiple of {INT4_GROUP} and N of 16, "
                                 f"got ({n}, {k})")
            q, scale, zero = quantize_int4(w)
            error = relative_error(dequantize_int4(q, scale, zero), w)
            packed = _pack_int4(q, device)
            # (K/group, N, 2): the layout both int4 matmuls take.
            sz = torch.stack((scale, zero), 2).transpose(0, 1).contiguous().to(device)
            return cls(fmt, (n, k), {"packed": packed, "scale_zero": sz}, torch.bfloat16, error)
        if fmt == "int8":
            q, scale = quantize_int8(w, half)
            error = relative_error(q.float() * scale.float()[:, None], w)
            return cls(fmt, (n, k), {"q": q.to(device), "scale": scale.to(device)}, half,
                       error, fast_int8)
        if fmt not in _FLOAT:
            raise ValueError(f"unknown tier format {fmt!r}; one of {', '.join(FORMATS)}")
        stored = w.to(_FLOAT[fmt])
        return cls(fmt, (n, k), {"w": stored.contiguous().to(device)}, _FLOAT[fmt],
                   relative_error(stored, w))

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) -> (T, N) in `compute`."""
        x = x.to(self.compute)
        t = self.tensors
        if self.fmt == "int4":
            return int4_ops(self.device).mm(x.contiguous(), t["packed"], INT4_GROUP,
                                            t["scale_zero"])
        if self.fmt == "int8":
            if self.fast_int8:
                return torch.ops.aten._weight_int8pack_mm(x.contiguous(), t["q"], t["scale"])
            return F.linear(x, t["q"].to(self.compute)) * t["scale"]
        return F.linear(x, t["w"])

    def dequantize(self) -> torch.Tensor:
        """The float32 W (N, K) these codes stand for, on the host (a reference for tests;
        int4 codes are read back by multiplying the identity, in float32 on the CPU)."""
        t = self.tensors
        if self.fmt == "int8":
            return t["q"].cpu().float() * t["scale"].cpu().float()[:, None]
        if self.fmt != "int4":
            return t["w"].cpu().float()
        if self.device.type != "cpu":
            raise ValueError("int4 tiles are read back on the CPU only")
        eye = torch.eye(self.shape[1])
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, t["packed"], INT4_GROUP, t["scale_zero"].float()).t().contiguous()


@dataclass(frozen=True)
class Int4Ops:
    """One device's int4 tiles: how codes (N, K) int32 in 0..15 go into its packer, the
    packer, and the matmul that reads its layout (the same codes and scales on every
    device; only the tile layout differs)."""

    codes: object  # (N, K) int32 -> what `pack` takes
    pack: object  # (that, inner K tiles) -> the device's tiles
    mm: object  # (x, tiles, group, scale_zero) -> x @ W^T


def _cuda_codes(q: torch.Tensor) -> torch.Tensor:
    return ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # two a byte, even index high


def int4_ops(device: torch.device) -> Int4Ops:
    """The int4 ops of `device`: CUDA's (`_convert_weight_to_int4pack`, which takes two codes
    a byte) or the CPU's (`..._for_cpu`, which takes the codes themselves). The one place the
    two devices' int4 code differs."""
    if torch.device(device).type == "cuda":
        return Int4Ops(_cuda_codes, torch.ops.aten._convert_weight_to_int4pack,
                       torch.ops.aten._weight_int4pack_mm)
    return Int4Ops(lambda q: q, torch.ops.aten._convert_weight_to_int4pack_for_cpu,
                   torch.ops.aten._weight_int4pack_mm_for_cpu)


def _pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Codes (N, K) int32 -> the device's int4 tiles (`int4_ops`)."""
    ops = int4_ops(device)
    return ops.pack(ops.codes(q).to(device), _inner_k_tiles(q.shape[1]))
