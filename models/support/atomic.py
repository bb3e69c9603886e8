"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

An interrupted write (Ctrl-C, kill, full disk) leaves the old file or nothing, never half a file.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write `path`'s new bytes into, piece by piece (a model fetched in parts):
    they take the name when the block ends, and are removed if it raises (a failed check)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable: without this a power cut can undo it (the new name
    is only in the directory's unwritten pages). Best effort where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
