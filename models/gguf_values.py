"""GGUF's metadata values read from a mapped file (gguf_file.py): every length and count is
checked against the bytes that remain before anything is read or allocated."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from .support.errors import ModelFormatError

MAX_ARRAY_NESTING = 2

# Fixed-size scalar value types: struct format (little-endian).
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


class Cursor:
    """Reads little-endian fields from the mapped file, never past its end."""

    def __init__(self, path: Path, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.remaining:
            raise ModelFormatError(
                self.path,
                f"{what} needs {nbytes} bytes at offset {self.pos} but the file has "
                f"{self.remaining} left (truncated or corrupt file)",
            )

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", f"length of {what}")
        self.need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(self.path, f"{what} is not valid UTF-8 ({exc.reason})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: `string` unrolled, since a vocabulary holds ~10^5 of
        them and the per-call checks would dominate (262k take ~0.1 s this way, ~1 s so)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            (length,) = length_at(buf, pos)
            pos += 8
            if length > end - pos:
                self.pos = pos
                self.need(length, f"{what}[{i}]")
            try:
                out[i] = str(buf[pos : pos + length], "utf-8")
            except UnicodeDecodeError as exc:
                raise ModelFormatError(
                    self.path, f"{what}[{i}] is not valid UTF-8 ({exc.reason})") from None
            pos += length
        self.pos = pos
        return out

    def array(self, count: int, vtype: GGUFValueType, what: str) -> np.ndarray:
        dtype = np.dtype(_NUMPY_DTYPES[vtype])
        self.need(count * dtype.itemsize, what)
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return out


def value_type(cur: Cursor, what: str) -> GGUFValueType:
    """A metadata value's type tag."""
    raw = cur.scalar("<I", f"type of {what}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ModelFormatError(cur.path, f"{what} has unknown value type {raw}") from None


def read_value(cur: Cursor, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
    """One metadata value of type `vtype` (arrays of numbers as numpy views of the file)."""
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype], what)
    if vtype == GGUFValueType.STRING:
        return cur.string(what)
    if vtype != GGUFValueType.ARRAY:
        raise ModelFormatError(cur.path, f"{what} has unknown value type {int(vtype)}")
    if depth >= MAX_ARRAY_NESTING:
        raise ModelFormatError(cur.path, f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep")
    item_type = value_type(cur, f"items of {what}")
    count = cur.scalar("<Q", f"length of {what}")
    if item_type in _NUMPY_DTYPES:
        return cur.array(count, item_type, what)
    # Strings and nested arrays take at least 8 bytes each: bound the count before looping.
    cur.need(count * 8, f"{count} items of {what}")
    if item_type == GGUFValueType.STRING:
        return cur.strings(count, what)
    return [read_value(cur, item_type, f"{what}[{i}]", depth + 1) for i in range(count)]
