"""How each decoder layer of a `FileBlocksModel` runs, fixed when the model is built.

A layer is described by a `LayerRun`: where its attention runs (on the host's file blocks
in C++, or on the GPU tier from `TierAttentionWeights`) and what computes its FFN (the
file's blocks in the same C++ call, or a callable: a hybrid split's `HybridFFN`, or the
whole FFN on the tier). `segments` groups a model's runs once, at build, into what one pass
calls in order:

    NativeRun  consecutive whole layers on the file's blocks: one C++ call for all of them
    SplitRun   one layer: attention in C++, then its FFN callable and the residual step
    TierRun    one layer: attention on the tier (kernels/tier_attention.py), its FFN callable

Every run reads and writes its layers' K/V in the pool the cache gives for them
(`cache.layer_pools()`, one entry per layer), each row at its own slots: with one pool all
runs share it; a plan with attention on a device tier for some layers and on the host for
others gets a cache whose tier layers' blocks are on the device and the host layers' in
host RAM (offload/kv/paged.py), so each run finds its K/V where its attention runs.
`PassRows` works out, once per pass and only for the layers that need them, the pool slots
each row reads (host runs), the `AttendRows` (tier runs) and the rows' rotary tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ember.kernels import decoder_step
from ember.kernels.fused_ops import residual_norm
from ember.kernels.tier_attention import (AttendRows, TierAttentionWeights, layer_ops,
                                          tier_attention)
from ember.models.tree_rows import TreeRows, tree_positions

CPU = torch.device("cpu")

# h (T, hidden) -> (T, hidden): a layer's FFN when not the file's blocks in C++
FFN = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerRun:
    """One layer's placement. attention None: C++ on the file's blocks in host RAM (or on a
    CPU tier holding the same bytes); ffn None: the layer's own FFN on the file's blocks, in
    the same C++ call as its attention (needs attention None)."""

    attention: TierAttentionWeights | None = None
    ffn: FFN | None = None

    def __post_init__(self):
        if self.attention is not None and self.ffn is None:
            raise ValueError("a layer with attention on the tier needs its FFN callable")

    @property
    def whole_native(self) -> bool:
        return self.attention is None and self.ffn is None


class PassRows:
    """What one pass of T rows at `start` (or a tree's rows) reads, per layer, made on first
    use: layers with one window share positions and masks, one rotary base its tables."""

    def __init__(self, start: int, T: int, cache, tree: TreeRows | None, rotary, windows):
        self.start, self.T, self.cache, self.tree = start, T, cache, tree
        self.rotary, self.windows = rotary, windows
        self._made: dict = {}

    def _tables(self, i: int, device: torch.device):
        key = ("rotary", id(self.rotary[i]), device)
        if key not in self._made:
            positions = self.start if self.tree is None else self.tree.positions
            self._made[key] = self.rotary[i].tables(positions, self.T, device)
        return self._made[key]

    @property
    def positions(self) -> torch.Tensor:
        """(T,) int64: each row's position (a tree's rows: their depth past the context)."""
        if self.tree is not None:
            return self.tree.positions
        return torch.arange(self.start, self.start + self.T)

    def host(self, layers: list[int]) -> tuple[list, torch.Tensor, list, list]:
        """For layers run in C++: per layer the pool slots each row reads (its own last), the
        rows' positions, and per layer the rows' cos/sin."""
        slots, cos, sin = [], [], []
        for i in layers:
            c, s = self._tables(i, CPU)
            cos.append(c)
            sin.append(s)
            slots.append(_slots(i, self.windows[i], self.start, self.T, self.cache, self.tree))
        return slots, self.positions, cos, sin

    def tier(self, i: int, device: torch.device) -> tuple[AttendRows, torch.Tensor, torch.Tensor]:
        """For a layer whose attention runs on the tier: its `AttendRows` and cos/sin there."""
        c, s = self._tables(i, device)
        return self._attend_rows(i, device), c, s

    def _attend_rows(self, layer: int, device: torch.device) -> AttendRows:
        window, start, T, cache, tree = (self.windows[layer], self.start, self.T, self.cache,
                                         self.tree)
        made = self._made
        if tree is not None:  # each row: the context in its window, then its ancestors
            positions, end = tree_positions(tree, window)
            table = cache.slots_of(layer, 0, end).to(device)
            if T == 1:  # exactly its keys, unmasked: the bits decoding that token gives
                keys = table.index_select(0, positions[0].to(table.device))
                return AttendRows(keys, keys[-1:], None)
            if ("tree", window, device) not in made:
                made["tree", window, device] = AttendRows.listed_mask(positions, end, device)
            mask, own = made["tree", window, device]
            return AttendRows(table, table.index_select(0, own), mask)
        lo = 0 if window is None else max(0, start - window + 1)
        if ("causal", window, device) not in made:
            made["causal", window, device] = AttendRows.causal_mask(lo, start, T, window, device)
        table = cache.slots_of(layer, lo, start + T).to(device)
        return AttendRows(table, table[start - lo:], made["causal", window, device])


def _slots(layer: int, window: int | None, start: int, T: int, cache,
           tree: TreeRows | None) -> list[torch.Tensor]:
    if tree is not None:  # each row: the context in its window, then its ancestors
        positions, end = tree_positions(tree, window)
        table = cache.slots_of(layer, 0, end)
        return [table.index_select(0, pos) for pos in positions]
    # Row t sits at position start + t and sees the keys in its window up to itself.
    first = [0 if window is None else max(0, start + t - window + 1) for t in range(T)]
    lo = first[0]
    table = cache.slots_of(layer, lo, start + T)
    return [table[first[t] - lo: start + t + 1 - lo] for t in range(T)]


class NativeRun:
    """Layers `idx` (consecutive, whole, on the file's blocks) in one C++ call."""

    device = CPU

    def __init__(self, idx: list[int], layers: list[decoder_step.DecoderLayer]):
        self.idx = idx
        self.run = decoder_step.decoder_step([layers[i] for i in idx])

    def __call__(self, x: torch.Tensor, pools, rows: PassRows) -> torch.Tensor:
        # consecutive whole host layers: one pool holds all their blocks
        return self.run(x, *pools[self.idx[0]], *rows.host(self.idx))


class SplitRun:
    """Layer `i`: attention in C++ (`attend(local, ...)`, a shared step over the split
    layers), then `ffn` and the residual step DecoderStep does after its own FFN."""

    device = CPU

    def __init__(self, i: int, local: int, attend, layer: decoder_step.DecoderLayer, ffn: FFN):
        self.i, self.local, self.attend, self.ffn = i, local, attend, ffn
        self.post_ffn_norm, self.eps = layer.post_ffn_norm, layer.eps

    def __call__(self, x: torch.Tensor, pools, rows: PassRows) -> torch.Tensor:
        slots, positions, cos, sin = rows.host([self.i])
        mid, h = self.attend(self.local, x, *pools[self.i], slots[0], positions, cos[0],
                             sin[0])
        return residual_norm(mid, self.ffn(h).contiguous(), self.post_ffn_norm, None,
                             self.eps)[0]


class TierRun:
    """Layer `i` with attention on the tier: the residual stream stays there (its FFN takes
    its input there and returns its sum there)."""

    def __init__(self, i: int, weights: TierAttentionWeights, ffn: FFN):
        self.i, self.w, self.ffn = i, weights, ffn
        self.device = weights.device
        self.ops = layer_ops(self.device)  # the small steps: Triton kernels on a CUDA tier

    def __call__(self, x: torch.Tensor, pools, rows: PassRows) -> torch.Tensor:
        w = self.w
        mid, h = tier_attention(w, x, *pools[self.i], *rows.tier(self.i, self.device), self.ops)
        f = self.ffn(h).float()
        return self.ops.residual_norm(mid, f, w.norm("post_ffn_norm"), None, w.eps)[0]


def segments(runs: list[LayerRun], layers: list[decoder_step.DecoderLayer]) -> list:
    """The runs of one model grouped into what a pass calls, in layer order (see the module
    docstring): whole native layers next to each other share one C++ call."""
    split = [i for i, r in enumerate(runs) if r.attention is None and r.ffn is not None]
    attend = decoder_step.layer_attention([layers[i] for i in split]) if split else None
    out, native = [], []
    for i, run in enumerate(runs):
        if run.whole_native:
            native.append(i)
            continue
        if native:
            out.append(NativeRun(native, layers))
            native = []
        if run.attention is None:
            out.append(SplitRun(i, split.index(i), attend, layers[i], run.ffn))
        else:
            out.append(TierRun(i, run.attention, run.ffn))
    if native:
        out.append(NativeRun(native, layers))
    return out
