"""The file's GGML blocks multiplied on a GPU in one Triton kernel per matrix: each block's
values decoded in registers as they are read and multiplied into x there, so the tier reads
exactly the file's bytes once per token and launches one kernel per matrix.

Why: the torch decoding path (`tier_blocks.tier_blocks_matmul`) decodes a tile of rows with
dozens of small torch ops and writes float32 intermediates before one matmul: on an H200 a
TinyLlama-1.1B layer took 3 ms that way (about a thousand torch ops a layer), which made the
GPU tier slower than the CPU. Here y (T, N) = x (T, K) @ W^T for a few rows of x (a decoded
token, a draft tree's rows): program (tile, t) decodes BLOCK_N rows of W for BLOCK_K values
at a time (each scale read once for the group of values it covers) and accumulates w * x[t]
elementwise, then sums each row once. A row's bits do not depend on T or on the rows beside
it (batch invariance: a verified tree's rows equal plain decoding's), and each value is
decoded as `models/block_decoders.py` decodes it (the same float32 operations in the same
order), so a one-hot x reads W's values exactly.

Types: Q4_0, Q5_0, Q8_0, Q4_K, Q6_K (what Q4_K_M files are made of); other types, and more
than `MAX_ROWS` rows of x (a prompt), take the torch decoding path. Triton comes with CUDA
builds of PyTorch (kernels/triton_support.py: without a CUDA device the same kernel runs in
Triton's interpreter, the tests' CPU path; `EMBER_TIER_TRITON=0` turns it off).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from . import triton_support

tl = None  # triton.language, bound by triton_support when the kernel is first compiled
bf16_bits = None  # triton_support.bf16_bits, as the kernel calls it (bound with tl)

MAX_ROWS = 32  # rows of x taken here (a token, a draft tree); more (a prompt) share one matmul
# The tile: the best geometric mean of GB/s over bench/tier_kernel_speed.py's 1.1B and 7B
# shapes on an H200 (393 against 304 for 4 x 256 on 1 warp; Q6_K rows gained most)
BLOCK_N = 4  # rows of W a program decodes
BLOCK_K = 512  # values of a row a program decodes at a time (two K-quant super-blocks)
NUM_WARPS = 2  # warps a program runs on

# GGML type -> (values a block holds, bytes a block takes, values one scale covers, its code)
_TYPES = {int(Q.Q4_0): (32, 18, 32, 0), int(Q.Q5_0): (32, 22, 32, 1),
          int(Q.Q8_0): (32, 34, 32, 2), int(Q.Q4_K): (256, 144, 32, 3),
          int(Q.Q6_K): (256, 210, 16, 4)}


def available() -> bool:
    """Whether the fused block kernel can run here: Triton installed (a CUDA device, or the
    interpreter, is `triton_support.usable`'s question)."""
    return triton_support.available()


def self_check(device: torch.device) -> bool:
    """Every type's kernel on `device` against the file's values: a one-hot x reads a few
    columns of W exactly (triton_support.checked runs it once before the tier uses it)."""
    from ember.models.quantize import quantize
    from ember.models.weights import QTensor

    g = torch.Generator().manual_seed(0)
    cols = torch.tensor([0, 1, 31, 32, 200, 255])
    x = torch.zeros(len(cols), 256)
    x[torch.arange(len(cols)), cols] = 1.0
    for qtype in _TYPES:
        t = QTensor(quantize(torch.randn(8, 256, generator=g), qtype), qtype, (8, 256))
        got = block_matmul(x.to(device), t.raw.to(device), qtype, t.shape).cpu()
        if not torch.equal(got, t.dequantize()[:, cols].t()):
            return False
    return True


def supports(qtype: int) -> bool:
    return int(qtype) in _TYPES


def block_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, shape,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) float @ W^T for W (N, K) in GGML type `qtype`, its blocks `raw` (flat uint8,
    rows as the file has them) on x's device: (T, N) float32, written into `out` where given
    (a (T, N) float32 view with unit column stride, e.g. columns of a wider result).
    T <= MAX_ROWS."""
    n, k = shape
    values, nbytes, group, code = _TYPES[int(qtype)]
    if k % values or raw.numel() != n * k // values * nbytes:
        raise ValueError(f"blocks of {raw.numel()} bytes are not a ({n}, {k}) type-{qtype} matrix")
    if raw.storage_offset() % 2:  # the float16 scales are read through a 2-byte view
        raw = raw.clone()
    x = x.float().contiguous()
    t = x.shape[0]
    if not 0 < t <= MAX_ROWS:
        raise ValueError(f"{t} rows of x: this kernel takes 1..{MAX_ROWS}")
    y = torch.empty(t, n, dtype=torch.float32, device=x.device) if out is None else out
    if y.shape != (t, n) or y.dtype != torch.float32 or (n > 1 and y.stride(1) != 1):
        raise ValueError(f"out must be ({t}, {n}) float32 with unit column stride")
    grid = ((n + BLOCK_N - 1) // BLOCK_N, t)
    _GEMV[grid](x, raw, raw.view(torch.float16), y, n, k, k // values * nbytes, y.stride(0),
                CODE=code, VALUES=values, BYTES=nbytes, GROUP=group, DECODE=False,
                BF16=False, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y


def decode_rows(raw: torch.Tensor, qtype: int, shape, r0: int, r1: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows r0..r1-1 of W (N, K) in GGML type `qtype` (its blocks `raw`, flat uint8) as
    (r1 - r0, K) values in `dtype`, decoded by the same kernel in one launch: GGML's values,
    rounded to `dtype` as torch rounds them (a prompt's tiles, then one matmul)."""
    n, k = shape
    values, nbytes, group, code = _TYPES[int(qtype)]
    row_bytes = k // values * nbytes
    if k % values or raw.numel() != n * row_bytes or not 0 <= r0 < r1 <= n:
        raise ValueError(f"rows {r0}..{r1} of blocks of {raw.numel()} bytes as a ({n}, {k}) "
                         f"type-{qtype} matrix")
    rows = raw[r0 * row_bytes:r1 * row_bytes]  # whole blocks: an even offset
    if rows.storage_offset() % 2:
        rows = rows.clone()
    out = torch.empty(r1 - r0, k, dtype=dtype, device=raw.device)
    bf16 = dtype == torch.bfloat16  # rounded by hand: as torch rounds, on any backend
    target = out.view(torch.int16) if bf16 else out
    grid = ((r1 - r0 + BLOCK_N - 1) // BLOCK_N, 1)
    _GEMV[grid](target, rows, rows.view(torch.float16), target, r1 - r0, k, row_bytes, k,
                CODE=code, VALUES=values, BYTES=nbytes, GROUP=group, DECODE=True, BF16=bf16,
                BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out


def _gemv_source(x_ptr, w_ptr, h_ptr, y_ptr, N, K, row_bytes, y_stride, CODE: tl.constexpr,
                 VALUES: tl.constexpr, BYTES: tl.constexpr, GROUP: tl.constexpr,
                 DECODE: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # Program (tile, t): rows tile*BLOCK_N.. of W against row t of x, BLOCK_K values of a row
    # at a time as (BLOCK_N, BLOCK_K // GROUP, GROUP) tiles: a group is the values one scale
    # covers, so scales and mins are loaded once a group (shape (.., .., 1)) and broadcast,
    # and each value reads only its own code bytes. DECODE: the values themselves are
    # stored to y (rows of y_stride, in y's type; BF16: y is int16 and takes the bfloat16
    # bits, rounded to nearest even here) instead, and x is not read.
    t = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < N
    row_at = rows.to(tl.int64)[:, None, None] * row_bytes  # byte offset of each row
    g = tl.arange(0, BLOCK_K // GROUP)[None, :, None]  # a group's place in the tile
    e = tl.arange(0, GROUP)[None, None, :]  # a value's place in its group
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP, GROUP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_group = k0 + g * GROUP  # first value of each group (K is whole groups)
        k_in = row_in[:, None, None] & (k_group < K)  # (rows, groups, 1)
        x_in = (k_group + e) < K
        at = row_at + k_group // VALUES * BYTES  # byte offset of each group's block
        pg = k_group % VALUES  # the group's first place in its block
        p = pg + e  # each value's place in its block
        if CODE == 0:  # Q4_0: d @0 | qs[16] @2; value p: nibble p // 16 of qs[p % 16], minus 8
            d = tl.load(h_ptr + at // 2, mask=k_in, other=0.0).to(tl.float32)
            qs = tl.load(w_ptr + at + 2 + p % 16, mask=k_in, other=0).to(tl.int32)
            w = (((qs >> (4 * (p // 16))) & 15) - 8).to(tl.float32) * d
        elif CODE == 1:  # Q5_0: d @0 | qh u32 @2 (bit p: value p's fifth bit) | qs[16] @6
            d = tl.load(h_ptr + at // 2, mask=k_in, other=0.0).to(tl.float32)
            qh = tl.load(w_ptr + at + 2 + p // 8, mask=k_in, other=0).to(tl.int32)
            qs = tl.load(w_ptr + at + 6 + p % 16, mask=k_in, other=0).to(tl.int32)
            q = (((qs >> (4 * (p // 16))) & 15) | (((qh >> (p % 8)) & 1) << 4)) - 16
            w = q.to(tl.float32) * d
        elif CODE == 2:  # Q8_0: d @0 | qs int8[32] @2
            d = tl.load(h_ptr + at // 2, mask=k_in, other=0.0).to(tl.float32)
            q = tl.load(w_ptr + at + 2 + p, mask=k_in, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d
        elif CODE == 3:  # Q4_K: d @0 | dmin @2 | scales[12] @4 | qs[128] @16
            # group = sub-block j: low nibbles of qs[32(j//2)..] for even j, high for odd;
            # its 6-bit scale and min from the 12 bytes (block_decoders._k_scale_min)
            j = pg // 32
            d = tl.load(h_ptr + at // 2, mask=k_in, other=0.0).to(tl.float32)
            dmin = tl.load(h_ptr + at // 2 + 1, mask=k_in, other=0.0).to(tl.float32)
            a = tl.load(w_ptr + at + 4 + j % 4, mask=k_in, other=0).to(tl.int32)
            b = tl.load(w_ptr + at + 8 + j % 4, mask=k_in, other=0).to(tl.int32)
            c = tl.load(w_ptr + at + 12 + j % 4, mask=k_in, other=0).to(tl.int32)
            sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4))
            mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
            qs = tl.load(w_ptr + at + 16 + 32 * (j // 2) + e, mask=k_in, other=0)
            q = (qs.to(tl.int32) >> (4 * (j % 2))) & 15
            w = q.to(tl.float32) * (d * sc.to(tl.float32)) - dmin * mn.to(tl.float32)
        else:  # Q6_K: ql[128] @0 | qh[64] @128 | scales int8[16] @192 | d @208
            # p = 128 half + 32 quarter + l: low 4 bits nibble (quarter // 2) of
            # ql[64 half + 32 (quarter % 2) + l], high 2 bits bits 2 quarter.. of
            # qh[32 half + l], minus 32; group p // 16 is scales[p // 16]
            half = p // 128
            quarter = (p // 32) % 4
            l = p % 32
            d = tl.load(h_ptr + (at + 208) // 2, mask=k_in, other=0.0).to(tl.float32)
            sc = tl.load(w_ptr + at + 192 + pg // 16, mask=k_in, other=0).to(tl.int8,
                                                                           bitcast=True)
            ql = tl.load(w_ptr + at + 64 * half + 32 * (quarter % 2) + l, mask=k_in, other=0)
            qh = tl.load(w_ptr + at + 128 + 32 * half + l, mask=k_in, other=0)
            q = ((ql.to(tl.int32) >> (4 * (quarter // 2))) & 15) | \
                (((qh.to(tl.int32) >> (2 * quarter)) & 3) << 4)
            w = (q - 32).to(tl.float32) * (d * sc.to(tl.float32))
        if DECODE:
            at_y = rows.to(tl.int64)[:, None, None] * y_stride + k_group + e
            if BF16:
                w = bf16_bits(w)
            tl.store(y_ptr + at_y, w.to(y_ptr.dtype.element_ty), mask=k_in & x_in)
        else:
            acc += w * tl.load(x_ptr + t * K + k_group + e, mask=x_in, other=0.0)
    if not DECODE:
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + t * y_stride + rows, y, mask=row_in)


_GEMV = triton_support.Kernel(_gemv_source, helpers=("bf16_bits",))
