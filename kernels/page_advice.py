"""madvise(2) on a range of this process's memory, for buffers that are not Python mmaps
(torch tensors): huge pages for big weight buffers (ffn_bundles), giving back the pages of
file copies that derived layouts replace (input-major tiles, offload/body/input_sparsity.py;
a split's cold side on the file's blocks, offload/hybrid/setup.py)."""

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


def release_pages(t) -> int:
    """madvise(MADV_DONTNEED) the whole pages inside tensor `t`'s bytes; returns how many
    bytes that covered (0 where the platform has no madvise). Only for views of a file's
    memory map: the pages are read again from the file; anonymous ones would read as zeros."""
    page = mmap.PAGESIZE
    start = t.data_ptr()
    lo = -(-start // page) * page
    hi = (start + t.numel() * t.element_size()) // page * page
    if hi <= lo or not madvise(lo, hi - lo, DONTNEED):
        return 0
    return hi - lo
