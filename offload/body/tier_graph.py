"""A decoded token through consecutive GPU-tier layers, replayed from one CUDA graph.

Why: a tier layer launches ~17 kernels for a token, and from Python each launch costs the host
more than the GPU spends on it. Measured on an H200 (bench/tier_profile.py, the 1.1B-shaped
file wholly on the tier): 32 ms of host time a token against 3.5 ms of GPU time. A graph
launches every kernel of the layers in one call.

A graph replays its kernels with the arguments they were captured with, so each input the
layers read must sit at a fixed address. `StepInputs` holds them: the token's hidden row, the
rotary rows of its position, and per layer the slot table of its K/V blocks, the span of it
the token reads (a count the attention kernel reads on the device, `AttendRows.span`) and
the slot its own K/V goes to (found on the device, one gather for all layers). Before each
step the host writes the position's numbers and rotary rows (one copy each) and a layer's
slot table only when the cache made a new one (a new block every block_size tokens, a
truncation, a swap). The layers are the model's own `TierRun`s given these inputs instead
of the pass's: the same kernels on the same values, so a replay gives the bits the layers
give when called (tests/test_tier_graph.py runs the fixed-input step on the CPU against the
runs themselves; bench/gpu_check.sh compares tokens on a GPU).

Only a decoded token (one row, no tree) goes through the graph; a prompt chunk and a
speculative tree's rows call the runs. Graphed layers need the tier's Triton steps (the
references read a span back to the host) and an FFN that does nothing on the host (a whole
tier FFN, not a split one). The first token is run as the layers run it, then captured;
a capture that fails leaves the layers to run as they are, with one warning.
`EMBER_CUDA_GRAPHS=0` turns graphs off.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from ember.kernels.tier_attention import TRITON_OPS, AttendRows

from .layer_runs import PassRows, TierRun

log = logging.getLogger("ember.offload")
ENV = "EMBER_CUDA_GRAPHS"
CPU = torch.device("cpu")
_FIRST_CAPACITY = 1024  # slot-table positions held at first (doubled when outgrown)


def wanted(device: torch.device) -> bool:
    """Whether decode steps on `device` are graphed: a CUDA device, unless EMBER_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get(ENV, "1") != "0"


def graphable(run) -> bool:
    """A layer a graph can replay: attention on the tier through the Triton steps, and an FFN
    that reports it does all its work on that device."""
    if not isinstance(run, TierRun) or run.ops is not TRITON_OPS:
        return False
    only_on = getattr(run.ffn, "runs_only_on", None)
    return only_on is not None and only_on(run.device)


class StepInputs:
    """The fixed buffers one decoded token's layers read: what `PassRows.tier` gives a layer
    in a pass, here at addresses that do not change between tokens."""

    def __init__(self, layers: list[int], rows: PassRows, hidden: int, device: torch.device,
                 capacity: int):
        self.layers, self.device, self.capacity = layers, device, capacity
        self._index = {layer: j for j, layer in enumerate(layers)}
        self.rotary = rows.rotary  # the model's tables (a new context makes new ones)
        at_id: dict[int, int] = {}  # per distinct table (layers share them): its index
        self._rotary_of = {i: at_id.setdefault(id(rows.rotary[i]), len(at_id)) for i in layers}
        self._rotaries = list({id(rows.rotary[i]): rows.rotary[i] for i in layers}.values())
        # a window per layer as a number (no window: longer than any context)
        self._windows = np.array([rows.windows[i] or 1 << 62 for i in layers], dtype=np.int64)
        n = len(layers)
        halves = [r.head_dim // 2 for r in self._rotaries]
        self.x = torch.zeros(1, hidden, device=device)
        # per rotary table its cos row then its sin row, side by side
        self.floats = torch.zeros(2 * sum(halves), device=device)
        self.cos, self.sin, at = [], [], 0
        for h in halves:
            self.cos.append(self.floats[at:at + h].view(1, h))
            self.sin.append(self.floats[at + h:at + 2 * h].view(1, h))
            at += 2 * h
        # per layer: the first key read, the keys read, the token's position
        self.ints = torch.zeros(n, 3, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, capacity, dtype=torch.int64, device=device)
        self.own = torch.zeros(n, 1, dtype=torch.int64, device=device)
        self._held: list[torch.Tensor | None] = [None] * n  # the slot tables copied in
        pinned = device.type == "cuda"  # copies from pinned memory do not wait for the GPU
        self._host_ints = torch.zeros(n, 3, dtype=torch.int64, pin_memory=pinned)
        self._host_floats = torch.zeros(self.floats.shape[0], pin_memory=pinned)

    def fill(self, x: torch.Tensor, rows: PassRows) -> bool:
        """This token's inputs written in; False when these buffers cannot serve the pass
        (new rotary tables, a slot table past their capacity: make new ones). The host
        buffers are rewritten next token only after the pass's hidden row came back to the
        host, which waits for these copies."""
        if rows.rotary is not self.rotary:
            return False
        for j, layer in enumerate(self.layers):
            table = rows.cache.slot_table(layer)
            if table is not self._held[j]:
                if table.shape[0] > self.capacity:
                    return False
                self.tables[j, :table.shape[0]].copy_(table, non_blocking=True)
                self._held[j] = table  # held: a new table is a new object
        start = rows.start
        first = np.maximum(0, start + 1 - self._windows)
        ints = self._host_ints.numpy()
        ints[:, 0], ints[:, 1], ints[:, 2] = first, start + 1 - first, start
        floats, at = self._host_floats, 0
        for rotary in self._rotaries:
            cos, sin = rotary.tables(start, 1, CPU)
            h = cos.shape[1]
            floats[at:at + h] = cos[0]
            floats[at + h:at + 2 * h] = sin[0]
            at += 2 * h
        self.ints.copy_(self._host_ints, non_blocking=True)
        self.floats.copy_(self._host_floats, non_blocking=True)
        self.x.copy_(x, non_blocking=True)

    def find_own_slots(self) -> None:
        """Each layer's slot for the token, looked up on the device (part of the graph)."""
        torch.gather(self.tables, 1, self.ints[:, 2:3], out=self.own)

    # what a TierRun asks a pass for (PassRows.tier)
    def tier(self, i: int, device: torch.device):
        j = self._index[i]
        r = self._rotary_of[i]
        return AttendRows(self.tables[j], self.own[j], None, self.ints[j, :2]), self.cos[r], \
            self.sin[r]


class GraphedTierRuns:
    """Consecutive tier layers on one device: a decoded token through their CUDA graph (the
    module docstring), anything else through the layers themselves. On a device that is not
    CUDA the fixed-input step runs without a graph (what the CPU's tests check)."""

    def __init__(self, runs: list[TierRun]):
        self.runs, self.device = runs, runs[0].device
        self.layers = [r.i for r in runs]
        self.capture = self.device.type == "cuda"
        self._inputs: StepInputs | None = None
        self._graph = None
        self._out: torch.Tensor | None = None
        self._pools: list | None = None  # the pools the graph was captured on
        self.graph_bytes: int | None = None  # the graph's memory pool (None: not captured)
        self.capture_s = 0.0
        self.replays = 0

    def __call__(self, x: torch.Tensor, pools, rows: PassRows) -> torch.Tensor:
        if rows.T != 1 or rows.tree is not None:
            for run in self.runs:
                x = run(x, pools, rows)
            return x
        if self._inputs is None or not self._inputs.fill(x, rows):
            self._new_inputs(x.shape[1], rows)
            self._inputs.fill(x, rows)
        if self._graph is not None and self._same_pools(pools):
            self._graph.replay()
            self.replays += 1
            return self._out.clone()
        out = self._step(pools)  # the token itself, eagerly (compiles what is new)
        if self.capture:
            self._capture(pools)
        return out

    def _new_inputs(self, hidden: int, rows: PassRows) -> None:
        # a power of two, at least _FIRST_CAPACITY: what the plan charges at most
        # (offload/hybrid/component_bytes.py:decode_graph_bytes)
        longest = max(rows.cache.slot_table(i).shape[0] for i in self.layers)
        capacity = _FIRST_CAPACITY
        while capacity < longest:
            capacity *= 2
        self._inputs = StepInputs(self.layers, rows, hidden, self.device, capacity)
        self._graph = None

    def _same_pools(self, pools) -> bool:
        return self._pools is not None and all(
            pools[i][0] is self._pools[j][0] and pools[i][1] is self._pools[j][1]
            for j, i in enumerate(self.layers))

    def _step(self, pools) -> torch.Tensor:
        inputs = self._inputs
        inputs.find_own_slots()
        x = inputs.x
        for run in self.runs:
            x = run(x, pools, inputs)
        return x

    def _capture(self, pools) -> None:
        t0 = time.perf_counter()
        # emptied first, as torch.cuda.graph does: what is reserved after is the graph's pool
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self._step(pools)
        except Exception as e:  # a step that cannot be captured costs speed, not the token
            log.warning("decode steps on %s are not graphed (%s: %s); the layers run as "
                        "they are (EMBER_CUDA_GRAPHS=0 silences this)", self.device,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.capture = False
            return
        self._graph, self._out = graph, out
        self._pools = [pools[i] for i in self.layers]
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_s = time.perf_counter() - t0


def graphed_segments(segments: list) -> list:
    """`segments` (layer_runs.segments) with each stretch of consecutive graphable tier layers
    on a device that wants graphs as one `GraphedTierRuns`."""
    out, stretch = [], []

    def close() -> None:
        if stretch:
            out.append(GraphedTierRuns(list(stretch)))
            stretch.clear()

    for segment in segments:
        joins = graphable(segment) and wanted(segment.device)
        if not joins or (stretch and stretch[0].device != segment.device):
            close()
        (stretch if joins else out).append(segment)
    close()
    return out
