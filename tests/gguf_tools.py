"""Byte-level surgery on GGUF files for tests of the validating reader."""

from __future__ import annotations

import struct
from pathlib import Path


def tensor_entry_offset(path: Path, name: str) -> int:
    """Byte offset of `name`'s directory entry (its u64 name length) in the file."""
    data = Path(path).read_bytes()
    needle = struct.pack("<Q", len(name)) + name.encode()
    pos = data.find(needle)
    if pos < 0:
        raise KeyError(name)
    return pos


def relabel_tensor_type(path: Path, name: str, new_type: int) -> None:
    data = bytearray(Path(path).read_bytes())
    pos = tensor_entry_offset(path, name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    type_pos = pos + 4 + 8 * n_dims
    struct.pack_into("<I", data, type_pos, int(new_type))
    Path(path).write_bytes(bytes(data))


def patch_u64_after_name(path: Path, name: str, field: str, value: int) -> None:
    """Overwrite a tensor's first dimension ('dim0') or data offset ('offset')."""
    data = bytearray(Path(path).read_bytes())
    pos = tensor_entry_offset(path, name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    target = pos + 4 if field == "dim0" else pos + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, target, value)
    Path(path).write_bytes(bytes(data))
