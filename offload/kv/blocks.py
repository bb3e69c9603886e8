"""Fixed-size KV blocks: a pool of storage on one tier and its reference-counted allocator.

A block holds `block_size` consecutive positions of one layer's K and V:
k[block] is (block_size, n_kv_heads, head_dim). Blocks are per layer so that a sliding-window
layer can give back the blocks its window has left behind while global layers keep theirs.
"""

from __future__ import annotations

import torch

from ember.kernels.page_advice import empty_on_huge_pages
from ember.models.support.errors import EmberError


class OutOfBlocks(EmberError):
    """A KV pool has no free block and nothing can be evicted."""


class BlockAllocator:
    """Free list plus reference counts. A block is free exactly when its count is 0."""

    def __init__(self, n_blocks: int):
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return len(self.refs) - len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfBlocks("KV pool is full")
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)


class KVPool:
    """K/V storage for `n_blocks` blocks on one device, with its allocator.

    k, v: (n_blocks, block_size, n_kv_heads, row_values): row_values is head_dim, or for a
    uint8 pool the bytes of a head's Q8_0 blocks (kernels.attention.kv_row_values). Host pools
    are pinned when CUDA is present so swaps can run asynchronously.
    """

    def __init__(self, n_blocks: int, block_size: int, n_kv_heads: int, row_values: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 pin: bool = False):
        shape = (n_blocks, block_size, n_kv_heads, row_values)
        # empty, not zeros: only written slots are ever read, and untouched pages of a large
        # host pool then cost no RAM until a swap uses them. A pool attention reads in host
        # RAM goes on huge pages: a decoded token streams every layer's K/V through it (6k
        # tokens of a 1.5B: 176 MB), and on 4 KiB pages its attention took ~10% longer.
        if torch.device(device).type == "cpu" and not pin:
            self.k, self.v = (empty_on_huge_pages(shape, dtype) for _ in "kv")
        else:
            self.k = torch.empty(shape, device=device, dtype=dtype, pin_memory=pin)
            self.v = torch.empty(shape, device=device, dtype=dtype, pin_memory=pin)
        # The same storage as (slots, n_kv_heads, head_dim), slot = block * block_size +
        # offset: what attention reads in place. Made once (a view per layer per token adds up).
        self.rows = (self.k.view(-1, n_kv_heads, row_values), self.v.view(-1, n_kv_heads, row_values))
        self.block_size = block_size
        self.allocator = BlockAllocator(n_blocks)

    @property
    def n_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[0].nbytes

    def copy_blocks(self, src: "KVPool", src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy whole blocks src_ids of `src` into our blocks dst_ids (any devices)."""
        if not src_ids:
            return
        s = torch.tensor(src_ids, device=src.k.device)
        d = torch.tensor(dst_ids, device=self.k.device)
        self.k.index_copy_(0, d, src.k.index_select(0, s).to(self.k.device, non_blocking=True))
        self.v.index_copy_(0, d, src.v.index_select(0, s).to(self.v.device, non_blocking=True))

