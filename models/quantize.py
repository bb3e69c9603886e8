"""Encode float tensors as GGML blocks (round to nearest), for writing tiny test models.

The block layouts are described in `quants.py`, which decodes them. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
and BF16 round exactly like gguf-py (and GGML's reference C quantizers); Q4_K/Q5_K/Q6_K use a
simple round-to-nearest scheme (valid blocks, not GGML's error-minimizing search).
"""

from __future__ import annotations

from typing import Callable

import torch

from .support.errors import UnsupportedModelError
from .quants import T, check_shape, type_name

__all__ = ["QUANTIZE_TYPES", "quantize"]


# --------------------------------------------------------------------------
# Quantization (round to nearest; for writing test models)
# --------------------------------------------------------------------------

def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 bytes [n, 2]."""
    return x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], 2)


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (C `roundf`)."""
    t = torch.trunc(v)
    frac = v - t  # exact
    return t + torch.where(frac.abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per row, the element of largest magnitude with its sign (first one on ties)."""
    return torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 2*k] values 0..15 -> [n, k] bytes: first half low nibbles, second half high."""
    k = q.shape[-1] // 2
    return (q[..., :k] & 0x0F) | (q[..., k:] << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[n, 8*k] 0/1 values -> [n, k] bytes, little-endian bit order."""
    n = bits.shape[0]
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (bits.reshape(n, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def _trunc_u8(v: torch.Tensor, hi: int) -> torch.Tensor:
    """GGML's `(uint8)(v)` after adding the rounding offset, clamped to 0..hi."""
    return torch.trunc(v).clamp_(0, hi).to(torch.uint8)


def _q_f32(x):
    return x.reshape(-1, 1).view(torch.uint8).reshape(-1, 4).clone()   # never alias the input


def _q_f16(x):
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _q_bf16(x):
    # Round to nearest even on the top 16 bits; NaNs stay (quiet) NaNs.
    n = x.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + 0x7FFF + ((n >> 16) & 1)) >> 16
    quiet_nan = (n >> 16) | 0x40
    h = torch.where(is_nan, quiet_nan, rounded) & 0xFFFF
    return torch.stack((h & 0xFF, h >> 8), dim=-1).to(torch.uint8)   # little-endian bytes


def _q_q8_0(x):
    # d = absmax / 127 (block scale), q = roundf(x / d); q uses the f32 d, the file stores fp16 d.
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = _round_away(x * _inverse(d)).clamp_(-128, 127).to(torch.int8)
    return torch.cat((_fp16_bytes(d), q.view(torch.uint8)), dim=1)


def _q_q4_0(x):
    # The signed absmax maps to -8; q = (uint8)(x / d + 8.5) clamped to 15.
    d = _signed_absmax(x) / -8
    q = _trunc_u8(x * _inverse(d) + 8.5, 15)
    return torch.cat((_fp16_bytes(d), _pack_nibbles(q)), dim=1)


def _q_q4_1(x):
    mn = x.amin(dim=1, keepdim=True)
    d = (x.amax(dim=1, keepdim=True) - mn) / 15
    q = _trunc_u8((x - mn) * _inverse(d) + 0.5, 15)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(mn), _pack_nibbles(q)), dim=1)


def _q_q5_0(x):
    # The signed absmax maps to -16; q = (uint8)(x / d + 16.5) clamped to 31.
    d = _signed_absmax(x) / -16
    q = _trunc_u8(x * _inverse(d) + 16.5, 31)
    return torch.cat((_fp16_bytes(d), _pack_bits(q >> 4), _pack_nibbles(q)), dim=1)


def _q_q5_1(x):
    mn = x.amin(dim=1, keepdim=True)
    d = (x.amax(dim=1, keepdim=True) - mn) / 31
    q = _trunc_u8((x - mn) * _inverse(d) + 0.5, 31)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(mn), _pack_bits(q >> 4), _pack_nibbles(q)), dim=1)


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _q_k_affine(x: torch.Tensor, levels: int):
    """Shared Q4_K/Q5_K quantizer (simple round to nearest, not GGML's search).

    Returns the 16 header bytes (d, dmin, 12 packed scale bytes) and q in
    0..levels, shaped [n, 8, 32].
    """
    n = x.shape[0]
    x = x.view(n, 8, 32)
    lo = x.amin(dim=-1).clamp(max=0)                 # mins are stored negated, >= 0
    scale = (x.amax(dim=-1) - lo) / levels
    d = _fp16_round(scale.amax(dim=-1, keepdim=True) / 63)
    dmin = _fp16_round((-lo).amax(dim=-1, keepdim=True) / 63)
    sc = _round_away(scale * _inverse(d)).clamp_(0, 63).to(torch.uint8)
    mn = _round_away(-lo * _inverse(dmin)).clamp_(0, 63).to(torch.uint8)
    step = (d * sc).unsqueeze(-1)
    offset = (dmin * mn).unsqueeze(-1)
    q = _round_away((x + offset) * _inverse(step)).clamp_(0, levels).to(torch.uint8)
    # Inverse of _k_scale_min.
    a = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    head = torch.cat((_fp16_bytes(d), _fp16_bytes(dmin), a, b, c), dim=1)
    return head, q


def _q_q4_k(x):
    head, q = _q_k_affine(x, 15)
    n = x.shape[0]
    # chunk c (32 bytes) holds sub-block 2c in low nibbles, 2c+1 in high nibbles
    qs = _pack_nibbles(q.reshape(n, 4, 64)).reshape(n, 128)
    return torch.cat((head, qs), dim=1)


def _q_q5_k(x):
    head, q = _q_k_affine(x, 31)
    n = x.shape[0]
    qs = _pack_nibbles((q & 0x0F).reshape(n, 4, 64)).reshape(n, 128)
    # qh[l] bit s = 5th bit of element l of sub-block s
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).view(1, 8, 1)
    qh = ((q >> 4) * weights).sum(dim=1, dtype=torch.uint8)
    return torch.cat((head, qh, qs), dim=1)


def _q_q6_k(x):
    # Simple round to nearest: each 16-element sub-block gets scale absmax/31
    # (so q fits -31..31), the int8 sub-scales are relative to d = max scale / 127.
    n = x.shape[0]
    x = x.view(n, 16, 16)
    scale = x.abs().amax(dim=-1) / 31
    d = _fp16_round(scale.amax(dim=-1, keepdim=True) / 127)
    sc = _round_away(scale * _inverse(d)).clamp_(-128, 127).to(torch.int8)
    step = (d * sc).unsqueeze(-1)
    q = _round_away(x * _inverse(step)).clamp_(-32, 31).to(torch.int8)
    u = (q.view(torch.uint8) + 32).reshape(n, 2, 4, 32)    # [n, half, k, l], 0..63
    low = u & 0x0F
    # ql[half*64 + (k%2)*32 + l]: low nibble from k = k%2, high nibble from k = 2 + k%2
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    high = u >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat((ql, qh, sc.view(torch.uint8), _fp16_bytes(d)), dim=1)


_QUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _q_f32,
    T.F16: _q_f16,
    T.BF16: _q_bf16,
    T.Q4_0: _q_q4_0,
    T.Q4_1: _q_q4_1,
    T.Q5_0: _q_q5_0,
    T.Q5_1: _q_q5_1,
    T.Q8_0: _q_q8_0,
    T.Q4_K: _q_q4_k,
    T.Q5_K: _q_q5_k,
    T.Q6_K: _q_q6_k,
}

QUANTIZE_TYPES: frozenset[int] = frozenset(int(t) for t in _QUANT)


def quantize(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """Encode a float tensor as GGML blocks along its last dimension; -> 1-D uint8.

    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 round exactly like gguf-py (and GGML's
    reference C quantizers); Q4_K/Q5_K/Q6_K use a simple round-to-nearest
    scheme (valid blocks, but not GGML's error-minimizing search).
    """
    if int(qtype) not in _QUANT:
        names = ", ".join(T(t).name for t in sorted(QUANTIZE_TYPES))
        raise UnsupportedModelError(
            "<tensor data>", f"quantizing to {type_name(qtype)} is not supported; supported: {names}"
        )
    numel, block_size, type_size = check_shape(qtype, tuple(x.shape))
    x = x.detach().to("cpu", torch.float32).contiguous()
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8)
    blocks = x.reshape(numel // block_size, block_size)
    packed = _QUANT[int(qtype)](blocks)
    assert packed.dtype == torch.uint8 and packed.shape[1] == type_size, (qtype, packed.shape)
    return packed.reshape(-1).contiguous()
