"""GGUF files split into parts, as llama.cpp's gguf-split writes them (and the Hugging Face
hub stores large models): `NAME-00001-of-00003.gguf`, `NAME-00002-of-00003.gguf`, ...

The first part holds all the metadata and some tensors; every part records `split.no`
(0-based) and `split.count`, and the first `split.tensors.count` (tensors in all parts).
A model is opened by its first part; the others are found beside it by name.
"""

from __future__ import annotations

import re
from pathlib import Path

SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_number(path: str | Path) -> tuple[int, int] | None:
    """(part, count), 1-based, that a split file's name says; None for another name."""
    m = _PART_NAME.match(Path(path).name)
    if m is None or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return int(m["no"]), int(m["count"])


def part_paths(first: Path, count: int) -> list[Path] | None:
    """The paths of all `count` parts of the model whose first part is `first` (the same
    folder, links kept as they are: a hub snapshot's parts are links to hashed blobs);
    None if the name does not follow the pattern."""
    m = _PART_NAME.match(first.name)
    if m is None or int(m["count"]) != count:
        return None
    return [first.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def first_part_name(path: Path) -> str | None:
    """The name of the first part of the split model `path` belongs to."""
    m = _PART_NAME.match(path.name)
    return None if m is None else f"{m['stem']}-00001-of-{m['count']}.gguf"


def model_stem(path: Path) -> str:
    """The file's name without `.gguf` and without the `-0000i-of-0000n` of a split."""
    m = _PART_NAME.match(path.name)
    return m["stem"] if m is not None else path.name.removesuffix(".gguf")
