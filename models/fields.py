"""Typed access to metadata read from files (GGUF key/values, config.json)."""

from __future__ import annotations

from typing import Any

from .support.errors import ModelFormatError

_CHECKS = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool) or v in (0, 1),
    str: lambda v: isinstance(v, str),
    list: lambda v: isinstance(v, list),
    dict: lambda v: isinstance(v, dict),
}


def typed(path, what: str, value: Any, kind: type) -> Any:
    """`value` converted to `kind` (ints pass for floats, 0/1 for bools), else a
    `ModelFormatError` naming the file and the field."""
    if not _CHECKS[kind](value):
        raise ModelFormatError(path, f"{what} should be {kind.__name__}, got {type(value).__name__}")
    return kind(value)
