"""The paged KV cache: sequences as per-layer block tables over a device pool and a host pool.

Verbs (nano-vllm's block manager, plus swapping):
- `allocate()` a new empty sequence, `free()` it;
- `fork()`: a new sequence sharing every block (reference counted); the first write into a
  shared block copies it first (copy-on-write), so forks never disturb each other;
- `truncate()`: roll back to a length (speculation, regenerate);
- `swap_out()` / `swap_in()`: move a whole sequence between the device pool and the host pool.
When the device pool runs out, the least recently used idle sequence is swapped out; when the
host pool runs out too, the least recently used idle host sequence is dropped: its blocks are
freed and it is marked `dropped`, so its owner recomputes it. Nothing is ever overwritten
silently.

Sliding-window layers release blocks that lie wholly before their window (keeping
`rollback_margin` extra positions so a short truncate still finds what it needs).

Layers split by place (`host_layers`): a model whose plan runs some layers' attention on a
device tier and others' on the host keeps each layer's K/V where its attention reads them:
the device pool holds the tier layers' blocks (in the tier's K/V type), a third pool in host
RAM the host layers' (in theirs). A sequence's `tier` then speaks of its device layers
alone: a swap moves only their blocks to the host pool and back, since the host layers'
blocks are in host RAM already and moving them would copy bytes to where they are (their
table entries and cached slots stay as they were). When the host layers' pool runs out,
swapping frees none of it, so the least recently used idle sequence is dropped. Fork,
copy-on-write, truncate and window release work per layer on the pool that layer uses. With
no `host_layers` there is one resident pool and everything is as it always was: decode reads
that pool in place by slot.

`view(seq_id)` gives the object the model's attention talks to (reserve/write/read/commit).
"""

from __future__ import annotations

import time

import torch

from ember.kernels.attention import kv_row_values
from ember.models.config import ModelConfig

from .blocks import KVPool, OutOfBlocks
from .plan import KVPlan
from .records import DEVICE, DROPPED, HOST, HostLayers, KVStats, Sequence, holds_blocks
from .sequence import SequenceKV

class PagedKVCache:
    def __init__(self, config: ModelConfig, device_blocks: int, host_blocks: int = 0,
                 block_size: int = 16, device: torch.device | str = "cpu",
                 rollback_margin: int = 64, dtype: torch.dtype = torch.float32,
                 host_layers: HostLayers | None = None):
        if block_size < 1 or device_blocks < 1 or host_blocks < 0:
            raise ValueError("block_size and device_blocks must be >= 1, host_blocks >= 0")
        dims = (block_size, config.n_kv_heads, kv_row_values(dtype, config.head_dim))
        pin = torch.device(device).type == "cuda"
        self.device_pool = KVPool(device_blocks, *dims, device=device, dtype=dtype)
        self.host_pool = KVPool(host_blocks, *dims, device="cpu", dtype=dtype, pin=pin)
        # Per layer: the pool its blocks live in while its sequence is resident, and while
        # it is swapped out (the host layers' own pool both times)
        self.resident = [self.device_pool] * config.n_layers
        self.host_layer_pool = None
        if host_layers is not None and host_layers.layers:
            if host_layers.blocks < 1:
                raise ValueError("a pool of host layers needs at least one block")
            self.host_layer_pool = KVPool(
                host_layers.blocks, block_size, config.n_kv_heads,
                kv_row_values(host_layers.dtype, config.head_dim), dtype=host_layers.dtype)
            for layer in host_layers.layers:
                self.resident[layer] = self.host_layer_pool
        self.swapped = [self.host_pool if p is self.device_pool else p for p in self.resident]
        # the layers a swap moves, and each layer's pool as (rows, n_kv_heads, head_dim)
        self.device_layers = [i for i, p in enumerate(self.resident) if p is self.device_pool]
        self.rows = [p.rows for p in self.resident]
        self.block_size = block_size
        self.n_layers = config.n_layers
        self.windows = [config.window(i) for i in range(config.n_layers)]
        self.rollback_margin = rollback_margin
        self.max_len = config.context_length
        self.seqs: dict[int, Sequence] = {}
        self.stats = KVStats()
        self._next_id = 0
        self._clock = 0
        # Sequences in the middle of a reserve or a swap: never chosen for eviction or drop.
        self._busy: set[int] = set()

    @classmethod
    def of_plan(cls, config: ModelConfig, plan: KVPlan, device: torch.device, dtype: torch.dtype,
                rollback_margin: int, host_kv: tuple[tuple[int, ...], torch.dtype] | None = None
                ) -> "PagedKVCache":
        """The cache `plan` sizes: one pool on `device` for every layer, or with `host_kv`
        (layers, dtype) split by layer, those layers' share of the plan's blocks in host RAM
        and the rest's on `device` (the swap pool then sized for the device layers alone)."""
        if not host_kv or not host_kv[0]:
            return cls(config, plan.device_blocks, plan.host_blocks, plan.block_size, device,
                       rollback_margin, dtype)
        layers, host_dtype = host_kv
        on_device = plan.blocks_of(i for i in range(config.n_layers) if i not in layers)
        swap = plan.host_blocks * on_device // plan.device_blocks
        return cls(config, on_device, swap, plan.block_size, device, rollback_margin, dtype,
                   HostLayers(tuple(layers), plan.blocks_of(layers), host_dtype))

    # -- sequence verbs -----------------------------------------------------------------
    def allocate(self) -> int:
        seq = Sequence(self._next_id, [[] for _ in range(self.n_layers)])
        self._next_id += 1
        self.seqs[seq.id] = seq
        self._touch(seq)
        return seq.id

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self._release_all(seq)

    def fork(self, seq_id: int) -> int:
        """A new sequence with the same contents, sharing blocks until either side writes."""
        src = self._get(seq_id)
        self._ensure_resident(src)
        child = Sequence(self._next_id, [list(t) for t in src.tables], src.length, src.tier)
        self._next_id += 1
        for pool, table in zip(self._pools(src), child.tables):
            for block in table:
                if block is not None:
                    pool.allocator.incref(block)
        self.seqs[child.id] = child
        self._touch(child)
        return child.id

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget positions >= length. Raises ValueError if released blocks would be needed:
        check `can_truncate` first and recompute instead."""
        seq = self._get(seq_id)
        if not self.can_truncate(seq_id, length):
            raise ValueError(f"cannot truncate sequence {seq_id} of length {seq.length} to {length}")
        keep = -(-length // self.block_size)
        pools = self._pools(seq)
        for layer, table in enumerate(seq.tables):
            if len(table) <= keep:
                continue  # unchanged: its cached slots stay valid (speculation truncates often)
            pool = pools[layer]
            for block in table[keep:]:
                if block is not None:
                    pool.allocator.decref(block)
            del table[keep:]
            seq.slot_cache.pop(layer, None)
        seq.length = length

    def compact(self, seq_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of positions `src` to positions `dst` in every layer (speculation:
        the accepted path of a token tree moves to consecutive positions). Both must lie in
        reserved, unshared blocks, e.g. within the last `reserve`."""
        seq = self._get(seq_id)
        if len(src) != len(dst):
            raise ValueError("compact needs as many source as destination positions")
        moves = [(s, d) for s, d in zip(src, dst) if s != d]
        if not moves:
            return
        for layer in range(self.n_layers):
            k, v = self.rows[layer]
            table = self.slot_table(seq, layer)[:max(max(m) for m in moves) + 1]
            s_slots = table[[m[0] for m in moves]]
            d_slots = table[[m[1] for m in moves]]
            k.index_copy_(0, d_slots, k.index_select(0, s_slots))
            v.index_copy_(0, d_slots, v.index_select(0, s_slots))

    def can_truncate(self, seq_id: int, length: int) -> bool:
        """Whether every block a truncated sequence still needs is held (not window-released)."""
        seq = self._get(seq_id)
        if seq.tier == DROPPED or not 0 <= length <= seq.length:
            return False
        for layer, table in enumerate(seq.tables):
            window = self.windows[layer]
            lo = 0 if window is None else max(0, length - window + 1)  # what position `length` sees
            first_block = lo // self.block_size
            last_block = (length - 1) // self.block_size
            if any(table[b] is None for b in range(first_block, last_block + 1)):
                return False
        return True

    def swap_out(self, seq_id: int) -> None:
        """Move a sequence's blocks to the host pool (dropping idle host sequences if full)."""
        seq = self._get(seq_id)
        if seq.tier != DEVICE:
            return
        self._move(seq, self.device_pool, self.host_pool, HOST)

    def swap_in(self, seq_id: int) -> None:
        """Bring a swapped-out sequence back to the device pool (evicting idle ones if full)."""
        seq = self._get(seq_id)
        if seq.tier == DROPPED:
            raise ValueError(f"sequence {seq_id} was dropped; recompute it")
        if seq.tier == HOST:
            self._move(seq, self.host_pool, self.device_pool, DEVICE)

    def view(self, seq_id: int) -> SequenceKV:
        return SequenceKV(self, self._get(seq_id))

    def usage(self) -> dict:
        d, h = self.device_pool.allocator, self.host_pool.allocator
        tiers = [s.tier for s in self.seqs.values()]
        split = {}
        if self.host_layer_pool is not None:
            r = self.host_layer_pool.allocator
            split = {"host_layer_blocks_used": r.n_used, "host_layer_blocks_free": r.n_free,
                     "host_layer_block_bytes": self.host_layer_pool.block_bytes}
        return {
            "block_size": self.block_size,
            "device_blocks_used": d.n_used, "device_blocks_free": d.n_free,
            "host_blocks_used": h.n_used, "host_blocks_free": h.n_free,
            "block_bytes": self.device_pool.block_bytes, **split,
            "sequences": {t: tiers.count(t) for t in (DEVICE, HOST, DROPPED)},
            **self.stats.__dict__,
        }

    # -- used by SequenceKV during a forward pass ------------------------------------------
    def reserve(self, seq: Sequence, n: int) -> None:
        """Make positions [length, length + n) writable on the device for every layer."""
        if seq.length + n > self.max_len:
            raise ValueError(f"context of {seq.length + n} tokens exceeds the model's "
                             f"maximum {self.max_len}")
        self._busy.add(seq.id)
        try:
            self._ensure_resident(seq)
            first, last = seq.length // self.block_size, (seq.length + n - 1) // self.block_size
            for layer, table in enumerate(seq.tables):
                pool = self.resident[layer]
                for b in range(first, last + 1):
                    if b >= len(table):
                        table.append(self._alloc_resident(seq, pool))
                    elif pool.allocator.refs[table[b]] > 1:
                        table[b] = self._copy_on_write(seq, pool, table[b])
                    else:
                        continue
                    seq.slot_cache.pop(layer, None)
        finally:
            self._busy.discard(seq.id)
        self._touch(seq)

    def slot_table(self, seq: Sequence, layer: int) -> torch.Tensor:
        """The flat pool slot (block * block_size + offset) of every position a layer's
        blocks hold, on its pool's device (positions lo..hi-1: `[lo:hi]`): one tensor, made
        when first asked for and the same object until the layer's blocks change (a new
        block, a truncation, a swap), so a caller holding it can tell."""
        flat = seq.slot_cache.get(layer)
        if flat is None:
            bs = self.block_size
            # Released blocks (None) map to slot 0; their positions are never read.
            blocks = torch.tensor([b if b is not None else 0 for b in seq.tables[layer]],
                                  dtype=torch.long)
            flat = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)
            flat = seq.slot_cache[layer] = flat.to(self.resident[layer].k.device)
        return flat

    def commit(self, seq: Sequence, n: int) -> None:
        seq.length += n
        self._release_outside_windows(seq)

    # -- internals ----------------------------------------------------------------------
    def _first_needed(self, layer: int, length: int) -> int:
        """Smallest position a query at >= length - rollback_margin may still attend to."""
        window = self.windows[layer]
        if window is None:
            return 0
        return max(0, length - self.rollback_margin - window + 1)

    def _release_outside_windows(self, seq: Sequence) -> None:
        pools = self._pools(seq)
        for layer, table in enumerate(seq.tables):
            if self.windows[layer] is None:
                continue
            dead_blocks = self._first_needed(layer, seq.length) // self.block_size
            for b in range(min(dead_blocks, len(table))):
                if table[b] is not None:
                    pools[layer].allocator.decref(table[b])
                    table[b] = None

    def _alloc_resident(self, seq: Sequence, pool: KVPool) -> int:
        """A block of `pool` (the device pool, or the host layers'), making room as needed:
        swapping out (device) or dropping (host layers) the least recently used idle one."""
        while True:
            try:
                return pool.allocator.alloc()
            except OutOfBlocks:
                room = self._evict_one(exclude=seq) if pool is self.device_pool \
                    else self._drop_one((DEVICE, HOST), exclude=seq)
                if not room:
                    raise OutOfBlocks(
                        f"the KV budget ({pool.n_blocks} blocks of "
                        f"{self.block_size} tokens per layer) cannot hold this context; raise "
                        "--kv-budget or lower --ctx-size") from None

    def _copy_on_write(self, seq: Sequence, pool: KVPool, block: int) -> int:
        fresh = self._alloc_resident(seq, pool)
        pool.copy_blocks(pool, [block], [fresh])
        pool.allocator.decref(block)
        self.stats.cow_copies += 1
        return fresh

    def _evict_one(self, exclude: Sequence) -> bool:
        """Swap out the least recently used idle device sequence; False if there is none."""
        idle = [s for s in self.seqs.values() if s.tier == DEVICE and s is not exclude
                and s.id not in self._busy and holds_blocks(s)]
        if not idle:
            return False
        self.swap_out(min(idle, key=lambda s: s.last_used).id)
        return True

    def _move(self, seq: Sequence, src: KVPool, dst: KVPool, tier: str) -> None:
        self._busy.add(seq.id)
        try:
            self._move_blocks(seq, src, dst, tier)
        finally:
            self._busy.discard(seq.id)

    def _move_blocks(self, seq: Sequence, src: KVPool, dst: KVPool, tier: str) -> None:
        t0 = time.perf_counter()
        moved = [seq.tables[i] for i in self.device_layers]  # the host layers' stay put
        ids = sorted({b for table in moved for b in table if b is not None})
        new_ids = self._alloc_many(dst, len(ids), seq)
        if new_ids is None and tier == HOST:  # both pools full: this idle sequence is dropped
            self._release_all(seq)
            seq.tier = DROPPED
            self.stats.dropped += 1
            return
        if new_ids is None:
            raise OutOfBlocks(f"the KV budget cannot hold sequence {seq.id} ({seq.length} "
                              "tokens) on the device; raise --kv-budget")
        dst.copy_blocks(src, ids, new_ids)
        mapping = dict(zip(ids, new_ids))
        for table in moved:
            for i, b in enumerate(table):
                if b is not None:
                    table[i] = mapping[b]
        for layer in self.device_layers:
            seq.slot_cache.pop(layer, None)
        for b in ids:
            src.allocator.decref(b)
        seq.tier = tier
        nbytes = len(ids) * src.block_bytes
        if tier == HOST:
            self.stats.swaps_out += 1
            self.stats.bytes_out += nbytes
        else:
            self.stats.swaps_in += 1
            self.stats.bytes_in += nbytes
        self.stats.swap_s += time.perf_counter() - t0

    def _alloc_many(self, pool: KVPool, n: int, seq: Sequence) -> list[int] | None:
        """n blocks from `pool`, making room by evicting (device) or dropping (host) idle
        sequences, least recently used first; None if that is not enough."""
        while pool.allocator.n_free < n:
            if pool is self.device_pool:
                if not self._evict_one(exclude=seq):
                    return None
            elif not self._drop_one((HOST,), exclude=seq):
                return None
        return [pool.allocator.alloc() for _ in range(n)]

    def _drop_one(self, tiers: tuple[str, ...], exclude: Sequence) -> bool:
        """Drop the least recently used idle sequence of `tiers` holding blocks; False if
        there is none."""
        idle = [s for s in self.seqs.values() if s.tier in tiers and s is not exclude
                and s.id not in self._busy and holds_blocks(s)]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        self._release_all(victim)
        victim.tier = DROPPED
        self.stats.dropped += 1
        return True

    def _release_all(self, seq: Sequence) -> None:
        if seq.tier == DROPPED:
            return
        for pool, table in zip(self._pools(seq), seq.tables):
            for b in table:
                if b is not None:
                    pool.allocator.decref(b)
        seq.tables = [[] for _ in range(self.n_layers)]
        seq.slot_cache.clear()

    def _ensure_resident(self, seq: Sequence) -> None:
        if seq.tier == HOST:
            self.swap_in(seq.id)
        if seq.tier == DROPPED:
            raise ValueError(f"sequence {seq.id} was dropped; recompute it")

    def _pools(self, seq: Sequence) -> list[KVPool]:
        """Per layer, the pool that holds a sequence's blocks now."""
        return self.swapped if seq.tier == HOST else self.resident

    def _get(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs:
            raise KeyError(f"no KV sequence {seq_id}")
        return self.seqs[seq_id]

    def _touch(self, seq: Sequence) -> None:
        self._clock += 1
        seq.last_used = self._clock

