"""The input-major tile layout in PyTorch (kernels/csrc/input_major.h says what it is and why):
`to_tiles` (the file's rows -> tiles, the C++ relayout's byte reference) and
`dequantize_tiles` (tiles -> the weight's values, equal to the file's dequantization bit for
bit: the layout is the file's bytes re-ordered, nothing rounded again).

A weight (N, K) of a type with super-blocks of QK inputs: per super-block, the header (each
row's d, then dmin/m, as fp16 arrays over Np = N rounded up to 64 rows; then each scale byte
as an array over the rows), then per input its run: low bits per group of 64 rows (4-bit:
byte j = row j | row 32 + j << 4; Q8_0: int8 per row), then high bits per group (Q5: bit r of
8 bytes; Q6_K: byte j = rows j, 16 + j, 32 + j, 48 + j at bits 0, 2, 4, 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

GROUP = 64


@dataclass(frozen=True)
class Format:
    qk: int           # inputs per super-block (the file's block)
    sub: int          # inputs per scale
    block: int        # the file's bytes per block
    halves: tuple     # fp16 header fields: offsets in the file's block (d first)
    scale_bytes: tuple  # one-byte header fields: offsets in the file's block
    low: int          # bytes per input and group of 64 rows
    high: int         # high-bit bytes per input and group
    offset: int       # stored integer + offset = the q the scale multiplies


FORMATS = {
    int(Q.Q4_0): Format(32, 32, 18, (0,), (), 32, 0, -8),
    int(Q.Q4_1): Format(32, 32, 20, (0, 2), (), 32, 0, 0),
    int(Q.Q5_0): Format(32, 32, 22, (0,), (), 32, 8, -16),
    int(Q.Q5_1): Format(32, 32, 24, (0, 2), (), 32, 8, 0),
    int(Q.Q8_0): Format(32, 32, 34, (0,), (), 64, 0, 0),
    int(Q.Q4_K): Format(256, 32, 144, (0, 2), tuple(range(4, 16)), 32, 0, 0),
    int(Q.Q5_K): Format(256, 32, 176, (0, 2), tuple(range(4, 16)), 32, 8, 0),
    int(Q.Q6_K): Format(256, 16, 210, (208,), tuple(range(192, 208)), 32, 16, -32),
}
# Float weights: no header, each input's run holds the values themselves (64 rows per group).
FLOATS = {int(Q.F32): torch.float32, int(Q.F16): torch.float16, int(Q.BF16): torch.bfloat16}
for _qt, _dt in FLOATS.items():
    _size = _dt.itemsize
    FORMATS[_qt] = Format(32, 32, 32 * _size, (), (), GROUP * _size, 0, 0)


def padded(n: int) -> int:
    return (n + GROUP - 1) // GROUP * GROUP


def header_and_run_bytes(qtype: int, n: int, k: int) -> tuple[int, int]:
    """(bytes of every super-block's header, bytes of one input's run over all rows): a call
    that keeps m inputs reads the headers of the super-blocks it touches and m runs."""
    f = FORMATS[int(qtype)]
    np_ = padded(n)
    header = np_ * (2 * len(f.halves) + len(f.scale_bytes))
    return k // f.qk * header, np_ // GROUP * (f.low + f.high)


def _file_q(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """(rows, supers, block bytes) uint8 -> the stored integers (rows, supers, QK) int32
    (unsigned as stored; Q8_0 signed)."""
    lo4 = lambda b: torch.cat((b & 15, b >> 4), -1)  # 16 bytes -> 32 values
    qt, n = int(qtype), blocks.shape[:2]
    if qt == Q.Q8_0:
        return blocks[..., 2:34].contiguous().view(torch.int8).int()
    if qt in (Q.Q4_0, Q.Q4_1):
        return lo4(blocks[..., -16:]).int()
    if qt in (Q.Q5_0, Q.Q5_1):
        at = 2 if qt == Q.Q5_0 else 4
        qh = blocks[..., at:at + 4].contiguous().view(torch.int32)
        bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1
        return lo4(blocks[..., -16:]).int() | (bits << 4)
    if qt in (Q.Q4_K, Q.Q5_K):
        qs = blocks[..., -128:].reshape(*n, 4, 32)
        q = torch.stack((qs & 15, qs >> 4), -2).reshape(*n, 256).int()
        if qt == Q.Q5_K:  # bit s of qh[l]: element 32 s + l's fifth bit
            qh = blocks[..., 16:48].int().unsqueeze(-2)
            q |= (((qh >> torch.arange(8).view(8, 1)) & 1) << 4).reshape(*n, 256)
        return q
    ql = blocks[..., 0:128].reshape(*n, 2, 2, 32).int()  # Q6_K: [half, k % 2, l]
    qh = blocks[..., 128:192].reshape(*n, 2, 1, 32).int()
    low = torch.stack((ql & 15, ql >> 4), -3).reshape(*n, 2, 4, 32)  # [half, k, l], k = 2 nib + k%2
    high = (qh >> (2 * torch.arange(4).view(4, 1))) & 3
    return (low | (high << 4)).reshape(*n, 256)


def to_tiles(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The file's rows (n * row bytes, uint8) -> the tiles' bytes."""
    f = FORMATS[int(qtype)]
    np_, supers, groups = padded(n), k // f.qk, padded(n) // GROUP
    blocks = torch.zeros(np_, supers, f.block, dtype=torch.uint8)
    blocks[:n] = raw.reshape(n, supers, f.block)
    if int(qtype) in FLOATS:  # (rows, supers, 32 values x size) -> (supers, 32, rows x size)
        size = FLOATS[int(qtype)].itemsize
        return blocks.reshape(np_, supers, f.qk, size).permute(1, 2, 0, 3).reshape(-1).clone()
    header = [blocks[..., o:o + 2].permute(1, 0, 2).reshape(supers, 2 * np_) for o in f.halves]
    header += [blocks[..., o].t() for o in f.scale_bytes]
    q = _file_q(blocks, qtype).permute(1, 2, 0).reshape(supers, f.qk, groups, GROUP)
    if f.low == 64:
        runs = [(q & 255).to(torch.uint8)]
    else:
        runs = [((q[..., :32] & 15) | ((q[..., 32:] & 15) << 4)).to(torch.uint8)]
    if f.high == 8:  # bit r of the group's 8 bytes
        bits = ((q >> 4) & 1).reshape(supers, f.qk, groups, 8, 8)
        runs.append((bits << torch.arange(8)).sum(-1).to(torch.uint8))
    elif f.high == 16:
        hb = ((q >> 4) & 3).reshape(supers, f.qk, groups, 4, 16)
        runs.append((hb << (2 * torch.arange(4).view(4, 1))).sum(-2).to(torch.uint8))
    quants = torch.cat([r.reshape(supers, f.qk, -1) for r in runs], -1).reshape(supers, -1)
    return torch.cat(header + [quants], 1).reshape(-1)


def _tile_q(quants: torch.Tensor, f: Format, groups: int) -> torch.Tensor:
    """(supers, QK, run bytes) -> the stored integers (supers, QK, Np) int32."""
    supers = quants.shape[0]
    low = quants[..., :groups * f.low].reshape(supers, f.qk, groups, f.low).int()
    if f.low == 64:
        q = low.to(torch.uint8).view(torch.int8).int()
        return q.reshape(supers, f.qk, -1)
    q = torch.cat((low & 15, low >> 4), -1)
    hi = quants[..., groups * f.low:].reshape(supers, f.qk, groups, -1).int()
    if f.high == 8:
        q |= ((hi.unsqueeze(-1) >> torch.arange(8)) & 1).reshape(supers, f.qk, groups, 64) << 4
    elif f.high == 16:
        q |= ((hi.unsqueeze(-2) >> (2 * torch.arange(4).view(4, 1))) & 3).reshape(
            supers, f.qk, groups, 64) << 4
    return q.reshape(supers, f.qk, -1)


def dequantize_tiles(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The tiles' weight as (n, k) float32, in the file's arithmetic (GGML's reference order:
    Q4_K (d * sc) * q - dmin * m, each product rounded to float32), so it equals the file's
    dequantization bit for bit."""
    f = FORMATS[int(qtype)]
    np_, supers, groups = padded(n), k // f.qk, padded(n) // GROUP
    if int(qtype) in FLOATS:
        values = packed.view(FLOATS[int(qtype)]).float().reshape(k, np_)
        return values[:, :n].t().contiguous()
    tiles = packed.reshape(supers, -1)
    at = 0
    halves = []
    for _ in f.halves:
        halves.append(tiles[:, at:at + 2 * np_].contiguous().view(torch.float16).float())
        at += 2 * np_
    scale = tiles[:, at:at + np_ * len(f.scale_bytes)].reshape(supers, -1, np_).int()
    q = _tile_q(tiles[:, at + np_ * len(f.scale_bytes):].reshape(supers, f.qk, -1), f, groups)
    q = (q + f.offset).float()  # (supers, QK, Np)
    subs = f.qk // f.sub
    d = halves[0].unsqueeze(1)  # (supers, 1, Np)
    if int(qtype) in (Q.Q4_K, Q.Q5_K):
        s = scale
        sc = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), 1)
        mn = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), 1)
        a, m = d * sc.float(), halves[1].unsqueeze(1) * mn.float()  # (supers, subs, Np)
    elif int(qtype) == Q.Q6_K:
        a, m = d * scale.to(torch.uint8).view(torch.int8).float(), None
    else:
        a, m = d, None
    w = q.reshape(supers, subs, f.sub, np_) * a.unsqueeze(2)
    if m is not None:
        w = w - m.unsqueeze(2)
    elif len(f.halves) == 2:  # Q4_1 / Q5_1: + m
        w = w + halves[1].unsqueeze(1).unsqueeze(2)
    return w.reshape(k, np_)[:, :n].t().contiguous()
