"""One sequence of the paged KV cache seen through the cache protocol the model's attention
uses (offload/kv/paged.py: `PagedKVCache.view`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .paged import PagedKVCache
    from .records import Sequence


@dataclass
class SequenceKV:
    """One sequence seen through the cache protocol the model's attention uses."""

    cache: PagedKVCache
    seq: Sequence

    @property
    def length(self) -> int:
        return self.seq.length

    def reserve(self, n: int) -> None:
        self.cache.reserve(self.seq, n)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.cache.slot_table(self.seq, layer)[start:start + k.shape[0]]
        k_pool, v_pool = self.cache.rows[layer]
        k_pool.index_copy_(0, slots, k)
        v_pool.index_copy_(0, slots, v)

    def slots_of(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Pool rows (of `pools()`) holding positions lo..hi-1 of a layer."""
        return self.cache.slot_table(self.seq, layer)[lo:hi]

    def slot_table(self, layer: int) -> torch.Tensor:
        """Pool rows of every position the layer's blocks hold: the same object until they
        change (PagedKVCache.slot_table)."""
        return self.cache.slot_table(self.seq, layer)

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device pool's K and V as (rows, n_kv_heads, head_dim): read in place by slot
        (every layer's, unless the cache keeps host layers apart: see `layer_pools`)."""
        return self.cache.device_pool.rows

    def layer_pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V rows of the pool its blocks live in (`slots_of` indexes
        them): the device pool's, or for a host layer beside a device tier its own pool's."""
        return self.cache.rows

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_pool, v_pool = self.cache.rows[layer]
        slots = self.slots_of(layer, lo, hi)
        return k_pool.index_select(0, slots), v_pool.index_select(0, slots)

    def commit(self, n: int) -> None:
        self.cache.commit(self.seq, n)

    def truncate(self, length: int) -> None:
        self.cache.truncate(self.seq.id, length)
