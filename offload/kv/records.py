"""The paged KV cache's records (offload/kv/paged.py): where a sequence's blocks are (its
tier), its per-layer block tables, the layers kept in host RAM beside a device tier, and the
cache's swap counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEVICE, HOST, DROPPED = "device", "host", "dropped"


@dataclass
class Sequence:
    """One sequence's place in the cache: its block tables, length, tier and last use."""

    id: int
    tables: list[list[int | None]]  # per layer: pool block id per logical block, None = released
    length: int = 0
    tier: str = DEVICE
    last_used: int = 0
    # Per layer, the flat pool slot of every position the table covers, built on demand and
    # dropped whenever the table changes: decode then slices it instead of rebuilding it.
    slot_cache: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HostLayers:
    """Layers whose attention runs on the host beside a device tier: their K/V live in a pool
    of `blocks` blocks of `dtype` in host RAM, never swapped."""

    layers: tuple[int, ...]
    blocks: int
    dtype: torch.dtype


@dataclass
class KVStats:
    """What swapping and sharing have cost so far (`PagedKVCache.usage`)."""

    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    swap_s: float = 0.0
    dropped: int = 0
    cow_copies: int = 0


def holds_blocks(seq: Sequence) -> bool:
    """Whether any layer of `seq` still holds a block (a dropped or empty one holds none)."""
    return any(b is not None for table in seq.tables for b in table)
