"""Hand the C heap's free memory back to the system after a large, short-lived load.

Hugging Face `tokenizers` parses a large tokenizer (Gemma 3's 262k tokens and 515k merges)
through about 300 MB of short-lived allocations; glibc keeps that freed memory in its arenas,
where it counts in the process's RSS until reused, so Ember would carry it for the whole
session. `malloc_trim` returns it. Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no libc by that name, or not glibc
        return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc only)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
