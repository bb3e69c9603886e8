"""madvise(2) on a range of this process's memory, for buffers that are not Python mmaps
(torch tensors): huge pages for big weight buffers (ffn_bundles), giving back the pages of
file copies that input-major tiles replace (offload/body/input_sparsity.py)."""

from __future__ import annotations

import ctypes
import mmap
import sys

_libc = None


def madvise(addr: int, nbytes: int, advice: int) -> bool:
    """madvise(addr, nbytes, advice); False where it failed or the platform has none (not
    Linux). `addr` must be page-aligned."""
    global _libc
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _libc.madvise(addr, nbytes, advice) == 0
    except (OSError, AttributeError):
        return False


HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
