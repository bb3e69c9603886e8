"""Weights on the GPU tier in the file's own GGML blocks (tier format "file", the default).

A `TierBlocks` is y (T, sum N_i) = x (T, K) @ [W_1; W_2; ...]^T for weights W_i (N_i, K)
that share K (q/k/v, gate/up), each kept as the file's bytes: the tier holds exactly the
bytes the file does (bits per weight of its GGML type), and its values are the file's
(error 0). Nothing is re-quantized. How the tier multiplies depends on its device, chosen in
one place (`block_kernels_on`):

    a CPU tier (the tests' stand-in, and the C++ kernels built)   kernels/block_matmul.py:
        the host's own arithmetic (x rounded to int8 per block, integer dot products), so a
        layer on the CPU tier computes the bits the unsplit model computes;
    any other device (CUDA), a decoded token or a draft tree        kernels/tier_blocks_triton.py:
        one Triton kernel per matrix decodes the blocks in registers and multiplies them
        into x (float32; the file's bytes read once, GGML's values bit for bit);
    a prompt's many rows, a type that kernel lacks, or no Triton   `tier_blocks_matmul`:
        a tile of rows at a time, the blocks decoded on the device (by the fused kernel in
        one launch where it serves, else by torch ops, models/quants.py:decode_blocks; GGML's
        values bit for bit either way) into the tier's 16-bit type, then one matmul.

`tier_blocks_matmul_reference` is the same product in float64 on the host, from the blocks'
values (`quants.dequantize`). Nothing here imports a GPU library: the tensors' device
decides where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.models import quants
from ember.models.weights import ROW_GROUP, QTensor

from . import block_matmul as bm
from . import tier_blocks_triton as fused_blocks
from . import triton_support

TILE_VALUES = 1 << 22  # weight values decoded at a time (16 MB of float32 intermediates)
FORMAT = "file"


def block_kernels_on(device: torch.device) -> bool:
    """Whether a tier on `device` multiplies the file's blocks with the C++ block kernels
    (a CPU tier, once they are built) rather than the torch decoding path (CUDA)."""
    return torch.device(device).type == "cpu" and bm.available()


def available() -> bool:
    """Always: the decoding path is plain torch ops on whatever device holds the blocks."""
    return True


def bits_per_weight(qtype: int) -> float:
    """What a weight of GGML type `qtype` takes on the tier in this format: the file's own."""
    values, nbytes = quants.block_info(int(qtype))
    return 8.0 * nbytes / values


@dataclass(frozen=True)
class TierBlocks:
    """W_i (N_i, K) in their GGML blocks on the tier (see the module docstring)."""

    parts: tuple[QTensor, ...]  # raw bytes on the tier device
    native: bool  # multiplied by the C++ block kernels (a CPU tier)
    half: torch.dtype  # the decoding path's matmul type
    fused: bool = False  # a few rows of x go to the fused Triton kernel (tier_blocks_triton)
    fmt: str = FORMAT
    error: float = 0.0  # the file's values themselves

    @classmethod
    def of(cls, tensors: list[QTensor], device: torch.device | str = "cpu",
           half: torch.dtype = torch.bfloat16) -> "TierBlocks":
        """The tensors' bytes on `device` (on the CPU the very same bytes: no copy). For the
        fused kernel, neighbours of one type become one matrix (their rows one after the
        other: gate and up, q and k), so one launch multiplies both."""
        device = torch.device(device)
        k = {t.shape[1] for t in tensors}
        if len(k) != 1:
            raise ValueError(f"weights multiplied together share K, got {sorted(k)}")
        # rows as the file has them (row groups are the host's one-token layout)
        host = [QTensor(t.file_layout().raw.reshape(-1), t.qtype, tuple(t.shape)) for t in tensors]
        native = block_kernels_on(device)
        fused = (not native and triton_support.usable(device)
                 and all(fused_blocks.supports(t.qtype) for t in host)
                 and triton_support.checked("block", device, fused_blocks.self_check))
        if fused:
            host = _same_types_joined(host)
        parts = tuple(QTensor(t.raw.to(device), t.qtype, t.shape) for t in host)
        return cls(parts, native, half, fused)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(t.shape[0] for t in self.parts), self.parts[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.parts[0].raw.device

    @property
    def compute(self) -> torch.dtype:
        return torch.float32

    @property
    def tensors(self) -> dict:
        return {f"part{i}": t.raw for i, t in enumerate(self.parts)}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) on the tier -> (T, sum N_i) float32 there."""
        if self.native:
            return bm.block_matmul(x.float().contiguous(), list(self.parts))
        if self.fused and x.shape[0] <= fused_blocks.MAX_ROWS:
            return fused_matmul(x, self.parts)
        if self.fused:  # a prompt: tiles decoded by the fused kernel, one launch each
            return tier_blocks_matmul(x, self.parts, self.half, _fused_tile)
        return tier_blocks_matmul(x, self.parts, self.half)

    def dequantize(self) -> torch.Tensor:
        """The float32 W (sum N_i, K) on the host: the file's values."""
        return torch.cat([t.dequantize() if t.raw.is_cpu else _decoded(t, 0, t.shape[0]).cpu()
                          for t in self.parts])


def _same_types_joined(parts: list[QTensor]) -> list[QTensor]:
    """Consecutive parts of one GGML type as one (sum of rows, K) part: the same bytes, joined
    on the host before they go to the tier (so the tier never holds both copies)."""
    joined: list[QTensor] = []
    for t in parts:
        if joined and joined[-1].qtype == t.qtype:
            last = joined.pop()
            t = QTensor(torch.cat([last.raw, t.raw]), t.qtype,
                        (last.shape[0] + t.shape[0], t.shape[1]))
        joined.append(t)
    return joined


def _decoded(t: QTensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1-1 of t as float32 (r1 - r0, K), decoded where its bytes are."""
    n, k = t.shape
    values, nbytes = quants.block_info(int(t.qtype))
    per_row = k // values
    blocks = t.raw.view(n * per_row, nbytes)[r0 * per_row: r1 * per_row]
    return quants.decode_blocks(blocks, int(t.qtype)).view(r1 - r0, k)


def fused_matmul(x: torch.Tensor, parts) -> torch.Tensor:
    """x (T, K) @ [W_i]^T by the fused Triton kernel, each W_i into its columns of one
    (T, sum N_i) float32 result (no concatenation)."""
    y = torch.empty(x.shape[0], sum(t.shape[0] for t in parts), dtype=torch.float32,
                    device=x.device)
    col = 0
    for t in parts:
        fused_blocks.block_matmul(x, t.raw, t.qtype, t.shape, out=y[:, col:col + t.shape[0]])
        col += t.shape[0]
    return y


def _torch_tile(t: QTensor, r0: int, r1: int, half: torch.dtype) -> torch.Tensor:
    return _decoded(t, r0, r1).to(half)


def _fused_tile(t: QTensor, r0: int, r1: int, half: torch.dtype) -> torch.Tensor:
    return fused_blocks.decode_rows(t.raw, t.qtype, t.shape, r0, r1, half)


def tier_blocks_matmul(x: torch.Tensor, parts, half: torch.dtype, tile=_torch_tile
                       ) -> torch.Tensor:
    """x (T, K) @ [W_i]^T with each W_i decoded a tile of rows at a time on its device into
    `half` (`tile(t, r0, r1, half)`: torch ops, or the fused kernel's one launch; the same
    values): (T, sum N_i) float32, on the weights' device."""
    xh = x.to(half)
    outs = []
    for t in parts:
        n, k = t.shape
        step = max(1, TILE_VALUES // max(1, k))
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            outs.append(F.linear(xh, tile(t, r0, r1, half)))
    return torch.cat(outs, dim=1).float() if outs else x.new_zeros(x.shape[0], 0)


def tier_blocks_matmul_reference(x: torch.Tensor, parts) -> torch.Tensor:
    """The same product in float64 on the host from the file's values: (T, sum N_i) float32."""
    w = torch.cat([QTensor(t.raw.cpu(), t.qtype, t.shape).dequantize() for t in parts])
    return (x.cpu().double() @ w.double().t()).float()


def down_columns(down: QTensor, groups: torch.Tensor) -> QTensor:
    """Down (hidden, ffn) restricted to whole blocks of its input (neuron) axis: `groups`
    (g,) block indices along a row -> (hidden, g * block values), verbatim bytes. A neuron's
    down weights are a column spread over every row's blocks, so a hot set taken from the
    file's blocks is a union of these block-aligned groups (kernels/hot_ffn.py:granule).
    Row groups are read in place: only the chosen blocks are copied, into the file's rows."""
    hidden, ffn = down.shape
    values, nbytes = quants.block_info(int(down.qtype))
    per_row = ffn // values
    groups = groups.to(down.raw.device)
    if down.grouped:  # (group, block, row in group, bytes) -> the chosen blocks, row by row
        raw = down.raw.reshape(hidden // ROW_GROUP, per_row, ROW_GROUP, nbytes).index_select(1, groups)
        raw = raw.transpose(1, 2)
    else:
        raw = down.raw.reshape(hidden, per_row, nbytes).index_select(1, groups)
    return QTensor(raw.reshape(-1).contiguous(), down.qtype, (hidden, len(groups) * values))
