"""A validating GGUF reader: metadata, tensor directory, memory-mapped tensor data.

Every field is checked against the file before it is used, because model files come from the
internet: counts and string lengths must fit in the bytes that remain, tensor extents must lie
inside the data section without overlapping, shapes must agree with the quant block size.
Nothing is allocated in proportion to a count read from the file until that count has been
checked against the file size. A model split into parts (gguf_split.py) is opened by its first
part and reads as one file: the tensors of every part, the first part's metadata.

The `gguf` package supplies the format's constants (value types, quant block sizes) and the
writer Ember uses for its tiny test models. Its `GGUFReader` is not used for loading: it takes
~20 s on the default model's 262k-token vocabulary, this reader well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .support.errors import ModelFormatError, UnsupportedModelError
from .fields import typed
from .gguf_values import Cursor, read_value, value_type
from .gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, first_part_name, part_paths
from .ram_copy import read_into_ram

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML tensors have at most four dimensions

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file.

    `shape` is in PyTorch order (outermost first): GGUF lists dimensions innermost first, so a
    weight GGUF calls [640, 2048] is shape (2048, 640) here, rows of 640 contiguous elements.
    """

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int  # absolute byte offset in the file (in its part, for a split model)
    nbytes: int
    part: int = 0  # which part of a split model holds it (`GGUFFile.parts`)

    @property
    def qtype_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name


class GGUFFile:
    """An open, validated GGUF file. Tensor data stays on disk until read (memory-mapped)."""

    def __init__(self, path: str | Path, *, part: int = 0, count: int = 1):
        """`path`: the file, or a split model's first part. `part` (0-based) and `count` are
        set only when the first part opens the others."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(self.path, "no such model file")
        size = self.path.stat().st_size
        if size < 24:
            raise ModelFormatError(self.path, f"only {size} bytes: too short to be a GGUF file")
        # Copy-on-write mapping: pages are shared with the page cache, and torch can wrap
        # slices without complaining that the buffer is read-only. Nothing is ever written.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        self.in_ram = False  # True once `read_into_ram` replaced the map by a copy in RAM
        cur = Cursor(self.path, memoryview(self._map))
        self._read_header(cur)
        self.metadata = self._read_metadata(cur)
        infos = self._read_tensor_directory(cur)
        self.alignment = self._alignment()
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(infos, size)
        self.parts: list[GGUFFile] = [self]  # a split model's parts, in order
        if part == 0:
            self._join_parts()
        else:
            self._check_part(part, count)

    # -- header and metadata ------------------------------------------------------------
    def _read_header(self, cur: Cursor) -> None:
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            raise ModelFormatError(self.path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.scalar("<I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise UnsupportedModelError(
                self.path, f"GGUF version {self.version} is not supported (supported: 2, 3)"
            )
        self.tensor_count = cur.scalar("<Q", "tensor count")
        self.kv_count = cur.scalar("<Q", "metadata count")
        # Each metadata entry takes >= 12 bytes (key length + type), each tensor entry >= 24.
        cur.need(self.kv_count * 12 + self.tensor_count * 24, "metadata and tensor directory")

    def _read_metadata(self, cur: Cursor) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for i in range(self.kv_count):
            key = cur.string(f"metadata key #{i}")
            vtype = value_type(cur, f"metadata '{key}'")
            if key in meta:
                raise ModelFormatError(self.path, f"metadata '{key}' appears twice")
            meta[key] = read_value(cur, vtype, f"metadata '{key}'")
        return meta

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(
                self.path, f"metadata 'general.alignment' must be a power of two, got {alignment!r}"
            )
        return alignment

    # -- split models -------------------------------------------------------------------
    def _join_parts(self) -> None:
        """Open the other parts of a split model and take in their tensors."""
        count = self.field(SPLIT_COUNT, int, 1)
        if count <= 1:
            return
        no = self.field(SPLIT_NO, int, 0)
        if no != 0:
            first = first_part_name(self.path) or "the one with split.no 0"
            raise ModelFormatError(self.path, f"part {no + 1} of {count} of a split model: "
                                              f"open its first part ({first})")
        paths = part_paths(self.path, count)
        if paths is None:
            raise ModelFormatError(
                self.path, f"split into {count} parts, but the name does not end in "
                           f"-00001-of-{count:05d}.gguf, so the other parts cannot be found")
        for i, path in enumerate(paths[1:], start=1):
            if not path.is_file():
                raise ModelFormatError(self.path, f"part {i + 1} of {count} is missing: "
                                                  f"{path.name} is not beside it")
            other = GGUFFile(path, part=i, count=count)
            self.parts.append(other)
            for name, info in other.tensors.items():
                if name in self.tensors:
                    raise ModelFormatError(path, f"tensor '{name}' is also in an earlier part")
                self.tensors[name] = replace(info, part=i)
        said = self.field(SPLIT_TENSORS, int, len(self.tensors))
        if said != len(self.tensors):
            raise ModelFormatError(self.path, f"metadata '{SPLIT_TENSORS}' says {said} tensors, "
                                              f"the {count} parts hold {len(self.tensors)}")

    def _check_part(self, part: int, count: int) -> None:
        got = (self.field(SPLIT_NO, int, None), self.field(SPLIT_COUNT, int, None))
        if got != (part, count):
            raise ModelFormatError(self.path, f"named as part {part + 1} of {count}, but its "
                                              f"metadata says split.no={got[0]}, "
                                              f"split.count={got[1]}")

    @property
    def nbytes(self) -> int:
        """Bytes of the file, or of all parts of a split model."""
        return sum(p.path.stat().st_size for p in self.parts)

    # -- tensors ------------------------------------------------------------------------
    def _read_tensor_directory(self, cur: Cursor) -> list[tuple[str, tuple[int, ...], int, int]]:
        infos = []
        for i in range(self.tensor_count):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.scalar("<I", f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFormatError(
                    self.path, f"tensor '{name}' has {n_dims} dimensions (allowed 1..{MAX_DIMS})"
                )
            dims = [cur.scalar("<Q", f"dimension of tensor '{name}'") for _ in range(n_dims)]
            qtype = cur.scalar("<I", f"type of tensor '{name}'")
            offset = cur.scalar("<Q", f"offset of tensor '{name}'")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        return infos

    def _place_tensors(self, infos, file_size: int) -> dict[str, TensorInfo]:
        data_size = file_size - self.data_offset
        if data_size < 0:
            raise ModelFormatError(self.path, "file ends before its tensor data section")
        tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            if name in tensors:
                raise ModelFormatError(self.path, f"tensor '{name}' appears twice")
            nbytes = self._tensor_nbytes(name, shape, qtype, data_size)
            if offset % self.alignment:
                raise ModelFormatError(
                    self.path, f"tensor '{name}' offset {offset} is not {self.alignment}-aligned"
                )
            if offset > data_size or nbytes > data_size - offset:
                raise ModelFormatError(
                    self.path,
                    f"tensor '{name}' ({nbytes} bytes at data offset {offset}) runs past the end "
                    f"of the file ({data_size} data bytes; truncated file?)",
                )
            tensors[name] = TensorInfo(name, shape, qtype, self.data_offset + offset, nbytes)
        by_offset = sorted(tensors.values(), key=lambda t: t.offset)
        for before, after in zip(by_offset, by_offset[1:]):
            if before.offset + before.nbytes > after.offset:
                raise ModelFormatError(
                    self.path, f"tensors '{before.name}' and '{after.name}' overlap"
                )
        return tensors

    def _tensor_nbytes(self, name: str, shape: tuple[int, ...], qtype: int, data_size: int) -> int:
        try:
            qname = GGMLQuantizationType(qtype).name
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise UnsupportedModelError(
                self.path, f"tensor '{name}' has unknown type id {qtype}"
            ) from None
        if any(d <= 0 for d in shape):
            raise ModelFormatError(self.path, f"tensor '{name}' has an empty dimension {shape}")
        if shape[-1] % block:
            raise ModelFormatError(
                self.path,
                f"tensor '{name}' rows of {shape[-1]} elements are not a multiple of the "
                f"{qname} block size {block}",
            )
        # Python ints do not overflow, but bound the product early to keep the message useful.
        elements = 1
        for d in shape:
            elements *= d
            if elements // block * type_size > data_size:
                raise ModelFormatError(
                    self.path, f"tensor '{name}' shape {shape} needs more bytes than the file has"
                )
        return elements // block * type_size

    # -- access -------------------------------------------------------------------------
    def read_into_ram(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Hold the file's bytes in RAM on huge pages instead of the map (see ram_copy.py).
        Views taken by `raw` before this keep reading the map; take them after."""
        total, before = self.nbytes, 0
        for part in self.parts:
            size = part.path.stat().st_size
            if size != len(part._map):
                raise ModelFormatError(part.path, "the file changed size while open")
            report = None if progress is None else (
                lambda done, _size, before=before: progress(before + done, total))
            part._map = read_into_ram(part.path, size, report)
            before += size
        self.in_ram = True

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a 1-D uint8 view of the map (or of the RAM copy): no copy."""
        info = self.tensors[name]
        return self.parts[info.part]._map[info.offset : info.offset + info.nbytes]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFormatError(self.path, "metadata 'general.architecture' is missing")
        return arch

    # -- typed metadata -----------------------------------------------------------------
    _MISSING = object()

    def field(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """Metadata `key` checked to be of `kind` (int, float, str, bool or list).

        Missing keys return `default`, or raise `ModelFormatError` naming the key when no
        default is given. Integers are accepted where floats are expected.
        """
        if key not in self.metadata:
            if default is GGUFFile._MISSING:
                raise ModelFormatError(self.path, f"metadata '{key}' is missing")
            return default
        value = self.metadata[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return typed(self.path, f"metadata '{key}'", value, kind)

    def arch_field(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """`field` of the architecture's own key: "rope.freq_base" reads "<arch>.rope.freq_base"."""
        return self.field(f"{self.architecture}.{key}", kind, default)
