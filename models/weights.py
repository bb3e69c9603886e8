"""Named weight tensors in their stored (possibly quantized) form.

A `QTensor` is the raw bytes of one tensor plus its GGML type and shape. It stays a view of the
memory-mapped file until someone asks for floats, so later kernels can read the quantized blocks
directly. A K-quant matrix in RAM may hold its rows in groups (`in_row_groups`): the same
blocks, reordered for the one-token AVX-512 kernel; every method here reads either layout.
`WeightStore` maps Ember's canonical tensor names (GGUF naming: `blk.3.ffn_up.weight`) to
QTensors, whatever the file format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from . import quants
from .support.errors import ModelFormatError
from .gguf_file import GGUFFile

_TORCH_TO_GGML = {
    torch.float32: GGMLQuantizationType.F32,
    torch.float16: GGMLQuantizationType.F16,
    torch.bfloat16: GGMLQuantizationType.BF16,
}


# Rows a row group interleaves: block b of its 16 rows side by side, then block b + 1 (the
# one-token AVX-512 kernel holds 16 rows in lanes and reads the group as one stream,
# kernels/csrc/block_gemv_groups_avx512.h).
ROW_GROUP = 16
_GROUPED_TYPES = frozenset(int(t) for t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                                            GGMLQuantizationType.Q6_K))
_GROUPING_CHUNK = 64 << 20  # bytes reordered at a time in place (the temporary copy's size)


@dataclass(frozen=True)
class QTensor:
    """One stored tensor: `raw` uint8 bytes (a view, not a copy), GGML `qtype`, torch `shape`;
    `grouped`: a matrix's rows in row groups (see `in_row_groups`), else as the file has them."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, ...]
    grouped: bool = False

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def qtype_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of `shape`."""
        return quants.dequantize(self.file_layout().raw, self.qtype, self.shape)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), cols] for selected rows of a 2-D tensor, reading only those rows."""
        return self.select_rows(rows).dequantize()

    def rows(self) -> torch.Tensor:
        """The bytes of a 2-D tensor as (n_rows, row_bytes) uint8, or in row groups as
        (n_rows / 16, 16, row_bytes), the form the block kernels take: a view, no copy."""
        n_rows, n_cols = self.shape
        row = quants.row_nbytes(self.qtype, n_cols)
        if self.grouped:
            return self.raw.view(n_rows // ROW_GROUP, ROW_GROUP, row)
        return self.raw.view(n_rows, row)

    def row_slice(self, start: int, stop: int) -> "QTensor":
        """Rows start..stop-1 of a 2-D tensor as a QTensor: a view of the same bytes (a fused
        projection's parts, e.g. Phi-3's q, k and v rows of `attn_qkv`); of row groups, a view
        where start and stop fall between groups, else a copy of those rows in file layout."""
        n_rows, n_cols = self.shape
        if not 0 <= start < stop <= n_rows:
            raise ValueError(f"rows {start}..{stop} outside a tensor of {n_rows} rows")
        if self.grouped and (start % ROW_GROUP or stop % ROW_GROUP):
            return self.select_rows(torch.arange(start, stop))
        row = quants.row_nbytes(self.qtype, n_cols)
        return QTensor(self.raw[start * row:stop * row], self.qtype, (stop - start, n_cols),
                       self.grouped)

    def select_rows(self, rows: torch.Tensor) -> "QTensor":
        """A new QTensor holding only `rows` of a 2-D tensor, still in the file's blocks and
        in the file's row layout (a copy of those rows' bytes)."""
        rows = rows.to(torch.long)
        if self.grouped:  # row r's blocks: group r // 16, every block, lane r % 16
            nbytes = quants.block_info(self.qtype)[1]
            groups = self.raw.view(-1, self._blocks_per_row(), ROW_GROUP, nbytes)
            picked = groups[rows // ROW_GROUP, :, rows % ROW_GROUP, :]
        else:
            picked = self.rows().index_select(0, rows)
        return QTensor(picked.reshape(-1), self.qtype, (len(rows), self.shape[1]))

    # -- row groups ------------------------------------------------------------------------
    def can_group(self) -> bool:
        """Whether this matrix can take row groups: a K-quant (the kernel that reads them)
        with whole groups of rows, not grouped already."""
        return (not self.grouped and int(self.qtype) in _GROUPED_TYPES and len(self.shape) == 2
                and self.shape[0] % ROW_GROUP == 0 and self.shape[0] > 0)

    def in_row_groups(self) -> "QTensor":
        """The same matrix with its rows in groups of 16, interleaved block by block: group
        g holds block 0 of rows 16g..16g+15, then block 1 of each, and so on. Reordered in
        place (its bytes must be writable and this matrix's alone: a RAM copy), so it costs
        no memory beyond a chunk's temporary; the returned QTensor is the one to use, this one
        no longer reads right. ValueError where `can_group` says no."""
        if not self.can_group():
            raise ValueError(f"a {self.qtype_name} tensor of shape {self.shape} cannot take "
                             f"row groups (K-quant matrices with rows in whole 16s only)")
        _, nbytes = quants.block_info(self.qtype)
        blocks, per_group = self.raw.view(-1, nbytes), ROW_GROUP * self._blocks_per_row()
        step = max(1, _GROUPING_CHUNK // (per_group * nbytes)) * per_group  # blocks at a time
        order = self._block_order(step, to_groups=True)
        for b0 in range(0, blocks.shape[0], step):
            part = blocks[b0:b0 + step]
            part.copy_(part.index_select(0, order[:part.shape[0]]))
        return QTensor(self.raw, self.qtype, self.shape, grouped=True)

    def file_layout(self) -> "QTensor":
        """This matrix with its rows as the file stores them: itself, or a copy of row groups
        taken back to rows (for readers that walk rows: dequantizing, GPU copies, tiles)."""
        if not self.grouped:
            return self
        _, nbytes = quants.block_info(self.qtype)
        blocks = self.raw.view(-1, nbytes)
        rows = blocks.index_select(0, self._block_order(blocks.shape[0], to_groups=False))
        return QTensor(rows.reshape(-1), self.qtype, self.shape)

    def _blocks_per_row(self) -> int:
        return self.shape[1] // quants.block_info(self.qtype)[0]

    def _block_order(self, n_blocks: int, to_groups: bool) -> torch.Tensor:
        """For n_blocks (whole groups) of this matrix, where each block of the other layout
        comes from: row groups are (group, block, row) order, the file (group, row, block).
        index_select copies whole blocks (a byte-wise transpose ran at a tenth the speed)."""
        nb = self._blocks_per_row()
        order = (-1, ROW_GROUP, nb) if to_groups else (-1, nb, ROW_GROUP)
        return torch.arange(n_blocks).view(order).transpose(1, 2).reshape(-1)

    @staticmethod
    def from_torch(t: torch.Tensor) -> "QTensor":
        """Wrap an unquantized torch tensor (float32/16, bfloat16) without copying."""
        if t.dtype not in _TORCH_TO_GGML:
            raise TypeError(f"unsupported weight dtype {t.dtype}")
        t = t.contiguous()
        return QTensor(t.view(torch.uint8).reshape(-1), int(_TORCH_TO_GGML[t.dtype]), tuple(t.shape))


class WeightStore:
    """Canonical tensor name -> QTensor, with errors that name the file and the tensor."""

    def __init__(self, path: Path, tensors: dict[str, QTensor], in_ram: bool = False,
                 mapped: bool = False):
        self.path = Path(path)
        self._tensors = tensors
        # Where a file's bytes live: False, the memory map (the page cache's pages); True, a
        # copy in RAM on huge pages (GGUFFile.read_into_ram). Either way the file's blocks.
        self.in_ram = in_ram
        # Whether the tensors are views of a file's memory map, whose pages the OS may take
        # back and read again from the file (page_advice: released copies). False for a RAM
        # copy and for tensors a library read into memory (safetensors' get_tensor): their
        # released pages would read as zeros.
        self.mapped = mapped

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> QTensor:
        """The tensor `name`; if `shape` is given it must match exactly."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelFormatError(self.path, f"tensor '{name}' is missing")
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ModelFormatError(
                self.path, f"tensor '{name}' has shape {tensor.shape}, expected {tuple(shape)}"
            )
        return tensor

    def load(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Dequantized float32 copy of `name` (shape-checked)."""
        tensor = self.get(name, shape)
        try:
            return tensor.dequantize()
        except ModelFormatError as exc:  # unsupported quant type: say which file and tensor
            raise type(exc)(self.path, f"tensor '{name}': {exc}") from None

    def replaced(self, changes: dict[str, QTensor | None]) -> "WeightStore":
        """A store with `changes` applied: a name set to a tensor, or dropped (None)."""
        tensors = dict(self._tensors)
        for name, tensor in changes.items():
            if tensor is None:
                tensors.pop(name, None)
            else:
                tensors[name] = tensor
        return WeightStore(self.path, tensors, in_ram=self.in_ram, mapped=self.mapped)

    def in_row_groups(self) -> "WeightStore":
        """This store with every matrix that can take row groups (`QTensor.can_group`) in
        them, reordered in place: only for a RAM copy (`in_ram`), whose bytes are this store's
        own and writable; the old store's views of those matrices no longer read right."""
        if not self.in_ram:
            raise ValueError(f"{self.path}: row groups reorder a RAM copy in place; this store "
                             "reads the file's memory map")
        return self.replaced({name: t.in_row_groups() for name, t in self._tensors.items()
                              if t.can_group()})

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "WeightStore":
        tensors = {
            name: QTensor(torch.from_numpy(np.asarray(gguf.raw(name))), info.qtype, info.shape)
            for name, info in gguf.tensors.items()
        }
        return cls(gguf.path, tensors, in_ram=gguf.in_ram, mapped=not gguf.in_ram)
