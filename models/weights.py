"""Named weight tensors in their stored (possibly quantized) form.

A `QTensor` is the raw bytes of one tensor plus its GGML type and shape. It stays a view of the
memory-mapped file until someone asks for floats, so later kernels can read the quantized blocks
directly. `WeightStore` maps Ember's canonical tensor names (GGUF naming: `blk.3.ffn_up.weight`)
to QTensors, whatever the file format.
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


@dataclass(frozen=True)
class QTensor:
    """One stored tensor: `raw` uint8 bytes (a view, not a copy), GGML `qtype`, torch `shape`."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def qtype_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of `shape`."""
        return quants.dequantize(self.raw, self.qtype, self.shape)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), cols] for selected rows of a 2-D tensor, reading only those rows."""
        return self.select_rows(rows).dequantize()

    def rows(self) -> torch.Tensor:
        """The bytes of a 2-D tensor as (n_rows, row_bytes) uint8: a view, no copy."""
        n_rows, n_cols = self.shape
        return self.raw.view(n_rows, quants.row_nbytes(self.qtype, n_cols))

    def row_slice(self, start: int, stop: int) -> "QTensor":
        """Rows start..stop-1 of a 2-D tensor as a QTensor: a view of the same bytes (a fused
        projection's parts, e.g. Phi-3's q, k and v rows of `attn_qkv`)."""
        n_rows, n_cols = self.shape
        if not 0 <= start < stop <= n_rows:
            raise ValueError(f"rows {start}..{stop} outside a tensor of {n_rows} rows")
        row = quants.row_nbytes(self.qtype, n_cols)
        return QTensor(self.raw[start * row:stop * row], self.qtype, (stop - start, n_cols))

    def select_rows(self, rows: torch.Tensor) -> "QTensor":
        """A new QTensor holding only `rows` of a 2-D tensor, still in the file's blocks (a
        copy of those rows' bytes)."""
        picked = self.rows().index_select(0, rows.to(torch.long))
        return QTensor(picked.reshape(-1), self.qtype, (len(rows), self.shape[1]))

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

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "WeightStore":
        tensors = {
            name: QTensor(torch.from_numpy(np.asarray(gguf.raw(name))), info.qtype, info.shape)
            for name, info in gguf.tensors.items()
        }
        return cls(gguf.path, tensors, in_ram=gguf.in_ram, mapped=not gguf.in_ram)
