"""Per-type GGML block decoders: raw blocks uint8 [n, type_size] -> float32
[n, block_size], all blocks of a chunk at once (used by `quants.dequantize`).

Bit-exactness: each kernel applies its scales in the same order as GGML's
reference C code (e.g. Q4_K computes `(d * sc) * q - (dmin * m)`, each
product rounded to float32 once), so the results equal GGML's bit for bit.

Block layouts (all multi-byte fields little-endian; "fp16" is IEEE half,
"d" is the block scale, "m"/"dmin" the block minimum; QK_K = 256):

    Q4_0  32 el, 18 B: d fp16 @0 | qs[16] @2      (el j: low nibble of qs[j], el j+16: high nibble)
    Q4_1  32 el, 20 B: d @0 | m @2 | qs[16] @4
    Q5_0  32 el, 22 B: d @0 | qh u32 @2 | qs[16] @6 (bit j of qh = 5th bit of el j)
    Q5_1  32 el, 24 B: d @0 | m @2 | qh @4 | qs[16] @8
    Q8_0  32 el, 34 B: d @0 | qs int8[32] @2
    Q2_K 256 el, 84 B: scales[16] @0 | qs[64] @16 | d @80 | dmin @82
    Q3_K 256 el,110 B: hmask[32] @0 | qs[64] @32 | scales[12] @96 | d @108
    Q4_K 256 el,144 B: d @0 | dmin @2 | scales[12] @4 | qs[128] @16
    Q5_K 256 el,176 B: d @0 | dmin @2 | scales[12] @4 | qh[32] @16 | qs[128] @48
    Q6_K 256 el,210 B: ql[128] @0 | qh[64] @128 | scales int8[16] @192 | d @208
    Q8_K 256 el,292 B: d f32 @0 | qs int8[256] @4 | bsums int16[16] @260

The per-kernel comments spell out which bits belong to which element.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType

T = GGMLQuantizationType

# --------------------------------------------------------------------------
# Field helpers
# --------------------------------------------------------------------------

def _field(blocks: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """One scalar field per block, as float32 `[n_blocks, 1]`.

    The bytes are copied out first (`.contiguous()`) so the dtype view is
    always on an aligned, dense buffer.
    """
    raw = blocks[:, start:start + dtype.itemsize].contiguous()
    return raw.view(dtype).to(torch.float32)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return _field(blocks, start, torch.float16)


def _cols(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes `start:stop` of every block, copied into a dense `[n_blocks, stop - start]`.

    Bit twiddling on a dense tensor is several times faster in torch than on
    the strided column slice (the copy is one cheap pass).
    """
    return blocks[:, start:stop].contiguous()


# _SPREAD_BITS[b, k] = ((b >> k) & 1) << 4: the 5th-bit contribution of bit k of byte b.
_SPREAD_BITS = torch.tensor([[((b >> k) & 1) << 4 for k in range(8)] for b in range(256)],
                            dtype=torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[..., n]` bytes -> `[..., 2, n]`: all low nibbles, then all high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., n]` bytes -> `[..., 8 // width, n]`: field k is bits k*width.. of each byte.

    (One shift per field and a stack: much faster in torch than one
    broadcast shift by a tensor of shift amounts.)
    """
    mask = (1 << width) - 1
    fields = [packed & mask] + [(packed >> s) & mask for s in range(width, 8, width)]
    return torch.stack(fields, dim=-2)


def _signed(q: torch.Tensor, offset: int) -> torch.Tensor:
    """uint8 `q` -> int8 `q - offset`, in place (the uint8 subtraction wraps, the view re-signs).

    Only ever called on a temporary.
    """
    return q.sub_(offset).view(torch.int8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into 8 scales and 8 mins (6 bits each).

    Bytes 0-3 (a), 4-7 (b), 8-11 (c), for sub-block j = 0..3:
        scale[j]   = a[j] & 63             min[j]   = b[j] & 63
        scale[j+4] = (c[j] & 15) | (a[j] >> 6) << 4
        min[j+4]   = (c[j] >> 4) | (b[j] >> 6) << 4
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return sc, mn


def _scaled(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
            minus: torch.Tensor | None = None, plus: torch.Tensor | None = None) -> None:
    """out = q * scale [- minus | + plus]  (q is integer; one float32 rounding per op).

    The integer -> float copy is exact, so this equals `q.float() * scale`; it is
    done as a copy plus an in-place multiply because torch's mixed-dtype
    `mul(int8, float32, out=)` is ~10x slower than the two same-dtype passes.
    """
    out.copy_(q)
    out.mul_(scale)
    if minus is not None:
        out.sub_(minus)
    if plus is not None:
        out.add_(plus)


# --------------------------------------------------------------------------
# Dequantization kernels: blocks uint8 [n, type_size] -> out float32 [n, block_size]
# --------------------------------------------------------------------------

def _dq_f32(blocks, out):
    out.copy_(blocks.view(torch.float32))


def _dq_f16(blocks, out):
    out.copy_(blocks.view(torch.float16))


def _dq_bf16(blocks, out):
    # bf16 is the top half of an f32: widen the bits, shift into place.
    bits = blocks.view(torch.int16).to(torch.int32) << 16
    out.copy_(bits.view(torch.float32))


def _dq_q4_0(blocks, out):
    # d fp16 @0 | qs[16] @2; el j = lo(qs[j]) - 8, el j+16 = hi(qs[j]) - 8
    n = blocks.shape[0]
    q = _signed(_nibbles(_cols(blocks, 2, 18)).reshape(n, 32), 8)
    _scaled(q, _f16(blocks, 0), out)


def _dq_q4_1(blocks, out):
    # d @0 | m @2 | qs[16] @4; el = d * q + m
    n = blocks.shape[0]
    q = _nibbles(_cols(blocks, 4, 20)).reshape(n, 32)
    _scaled(q, _f16(blocks, 0), out, plus=_f16(blocks, 2))


def _q5_quants(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    # 4 bytes qh (a little-endian u32: bit j = byte j//8, bit j%8) then 16 bytes qs.
    n = blocks.shape[0]
    low = _nibbles(_cols(blocks, qh_at + 4, qh_at + 20)).reshape(n, 32)
    # Element j needs bit j % 8 of byte j // 8: a table lookup per qh byte gives
    # its 8 bits already in element order (and shifted into place).
    qh = _cols(blocks, qh_at, qh_at + 4).view(-1).to(torch.int32)
    high = _SPREAD_BITS.index_select(0, qh).view(n, 32)
    return low | high


def _dq_q5_0(blocks, out):
    # d @0 | qh @2 | qs[16] @6; el = d * (q - 16)
    _scaled(_signed(_q5_quants(blocks, 2), 16), _f16(blocks, 0), out)


def _dq_q5_1(blocks, out):
    # d @0 | m @2 | qh @4 | qs[16] @8; el = d * q + m
    _scaled(_q5_quants(blocks, 4), _f16(blocks, 0), out, plus=_f16(blocks, 2))


def _dq_q8_0(blocks, out):
    # d @0 | qs int8[32] @2
    _scaled(blocks[:, 2:34].view(torch.int8), _f16(blocks, 0), out)


def _dq_q2_k(blocks, out):
    # scales[16] @0 (lo nibble: scale, hi nibble: min) | qs[64] @16 | d @80 | dmin @82
    # Two halves of 128 elements, each from 32 qs bytes; el = half*128 + j*32 + l
    # is bits 2j..2j+1 of qs[half*32 + l], in sub-block (half*8 + j*2 + l//16).
    n = blocks.shape[0]
    sc = _cols(blocks, 0, 16)
    q = _bits(_cols(blocks, 16, 80).view(n, 2, 32), 2)          # [n, half, j, l]
    dl = (_f16(blocks, 80) * (sc & 0x0F)).unsqueeze(-1)
    ml = (_f16(blocks, 82) * (sc >> 4)).unsqueeze(-1)
    _scaled(q.reshape(n, 16, 16), dl, out.view(n, 16, 16), minus=ml)


def _dq_q3_k(blocks, out):
    # hmask[32] @0 | qs[64] @32 | scales[12] @96 | d @108
    # el = half*128 + j*32 + l: low 2 bits as in Q2_K, 3rd bit = bit (half*4 + j)
    # of hmask[l]; q = low - (bit ? 0 : 4).  Sub-block (16 el) scales are 6-bit,
    # biased by 32: scale i = lo4 | hi2 << 4 with
    #   lo4 = (scales[i % 8] >> 4*(i // 8)) & 15,  hi2 = (scales[8 + i % 4] >> 2*(i // 4)) & 3
    n = blocks.shape[0]
    low = _bits(_cols(blocks, 32, 96).view(n, 2, 32), 2).reshape(n, 8, 32)
    high = _bits(_cols(blocks, 0, 32), 1)                           # [n, bit, l]
    q = _signed(low | (high << 2), 4)
    s = _cols(blocks, 96, 108)
    lo4 = _nibbles(s[:, 0:8]).reshape(n, 16)
    hi2 = _bits(s[:, 8:12], 2).reshape(n, 16)
    sc = _signed(lo4 | (hi2 << 4), 32)
    dl = (_f16(blocks, 108) * sc).unsqueeze(-1)
    _scaled(q.reshape(n, 16, 16), dl, out.view(n, 16, 16))


def _dq_q4_k(blocks, out):
    # d @0 | dmin @2 | scales[12] @4 | qs[128] @16
    # 4 chunks of 32 bytes; chunk c gives sub-block 2c (low nibbles) and 2c+1 (high).
    n = blocks.shape[0]
    sc, mn = _k_scale_min(_cols(blocks, 4, 16))
    q = _nibbles(_cols(blocks, 16, 144).view(n, 4, 32)).reshape(n, 8, 32)
    dl = (_f16(blocks, 0) * sc).unsqueeze(-1)
    ml = (_f16(blocks, 2) * mn).unsqueeze(-1)
    _scaled(q, dl, out.view(n, 8, 32), minus=ml)


def _dq_q5_k(blocks, out):
    # d @0 | dmin @2 | scales[12] @4 | qh[32] @16 | qs[128] @48
    # Low 4 bits as in Q4_K; the 5th bit of element l of sub-block s is bit s of qh[l].
    n = blocks.shape[0]
    sc, mn = _k_scale_min(_cols(blocks, 4, 16))
    low = _nibbles(_cols(blocks, 48, 176).view(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(_cols(blocks, 16, 48), 1)                          # [n, s, l]
    dl = (_f16(blocks, 0) * sc).unsqueeze(-1)
    ml = (_f16(blocks, 2) * mn).unsqueeze(-1)
    _scaled(low | (high << 4), dl, out.view(n, 8, 32), minus=ml)


def _dq_q6_k(blocks, out):
    # ql[128] @0 | qh[64] @128 | scales int8[16] @192 | d @208
    # el = half*128 + k*32 + l  (k = 0..3, l = 0..31):
    #   low 4 bits: nibble (k // 2) of ql[half*64 + (k % 2)*32 + l]
    #   high 2 bits: bits 2k..2k+1 of qh[half*32 + l]
    #   q - 32, scaled by scales[half*8 + k*2 + l // 16]
    n = blocks.shape[0]
    low = _nibbles(_cols(blocks, 0, 128).view(n, 2, 64)).reshape(n, 2, 4, 32)
    high = _bits(_cols(blocks, 128, 192).view(n, 2, 32), 2)      # [n, half, k, l]
    q = _signed(low | (high << 4), 32)
    sc = _cols(blocks, 192, 208).view(torch.int8)
    dl = (_f16(blocks, 208) * sc).unsqueeze(-1)
    _scaled(q.reshape(n, 16, 16), dl, out.view(n, 16, 16))


def _dq_q8_k(blocks, out):
    # d f32 @0 | qs int8[256] @4 | bsums int16[16] @260 (bsums only speed up dot products)
    _scaled(blocks[:, 4:260].view(torch.int8), _field(blocks, 0, torch.float32), out)


DEQUANT: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _dq_f32,
    T.F16: _dq_f16,
    T.BF16: _dq_bf16,
    T.Q4_0: _dq_q4_0,
    T.Q4_1: _dq_q4_1,
    T.Q5_0: _dq_q5_0,
    T.Q5_1: _dq_q5_1,
    T.Q8_0: _dq_q8_0,
    T.Q2_K: _dq_q2_k,
    T.Q3_K: _dq_q3_k,
    T.Q4_K: _dq_q4_k,
    T.Q5_K: _dq_q5_k,
    T.Q6_K: _dq_q6_k,
    T.Q8_K: _dq_q8_k,
}
