"""madvise(2) on a range of this process's memory, for buffers that are not Python mmaps
(torch tensors): huge pages for big buffers streamed every token (`empty_on_huge_pages`:
neuron bundles, kernels/ffn_bundles.py; the KV pool, offload/kv/blocks.py), giving back the
pages of file copies that derived layouts replace (input-major tiles,
offload/body/input_sparsity.py; a split's cold side on the file's blocks,
offload/hybrid/setup.py)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

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


HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from two huge pages up, 2 MiB-aligned and advised onto
    transparent huge pages before its first touch (torch's own allocations are 64-byte
    aligned, and where Linux gives huge pages only on request they stay on 4 KiB pages): a
    stream through it then misses the TLB once per 2 MiB instead of once per 4 KiB. Its
    storage is a larger byte buffer the tensor keeps alive."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < 2 * HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + off, nbytes, HUGEPAGE)  # a no-op where unsupported
    return raw[off:off + nbytes].view(dtype).view(shape)
