"""A FFN layer split by a placement: hot neurons on the GPU tier, cold ones in host RAM.

    out = hot_ffn(x on the GPU tier) + sparse_ffn(x on the host, active cold neurons)

The cold side is submitted to the CPU worker first, then the calling thread runs the hot
side, so the two overlap; the partial down-projections are summed on the caller's device.
A selector picks the cold neurons to compute for a token (None: all of them, the exact
dense result); prefill chunks (T > 1) always compute every cold neuron, since the union of
many tokens' active sets is nearly everything. GLU layers of a profile with input thresholds
have no selector: their cold side drops, per token, the neurons whose down input is under the
profile's threshold, after computing gate and up (`down_threshold`).

Weights are plain attributes, not buffers, so `Transformer.to(device)` (which moves
attention and norms to their tier) leaves each side where the plan put it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from ember.kernels.hot_ffn import HotFFNWeights, file_types, granule, hot_ffn
from ember.kernels.tier_blocks import down_columns
from ember.kernels.sparse_ffn import SparseFFNWeights, sparse_ffn, sparse_ffn_thresholded
from ember.models.transformer import activate

from .cpu_worker import CpuWorker
from .file_cold import FileColdFFN
from ..body.ffn_rows import as_rows
from .tier_dtypes import TierChoice
from .tier_transfer import TierTransfer

# x (T, hidden) on the host -> cold-local neuron indices to compute (sorted int64), or None
# for all of them.
Selector = Callable[[torch.Tensor], "torch.Tensor | None"]


def bundle_dtype(cold_dtype: str) -> str:
    """The cold bundles' type under --cold-dtype (the layers "file" cannot serve get int8)."""
    return "int8" if cold_dtype == "file" else cold_dtype


@dataclass
class LayerCounters:
    """What one layer computed, for the sparsity report."""

    tokens: int = 0  # decode tokens seen (prefill chunks are dense and not counted)
    cold_computed: int = 0  # cold neurons computed over those tokens
    # Seconds over those tokens: the hot side (copies and its one sync included), the cold
    # side on its CPU thread, and what the caller waited for the cold side after the hot.
    hot_s: float = 0.0
    cold_s: float = 0.0
    wait_s: float = 0.0

    def reset(self) -> None:
        self.tokens = self.cold_computed = 0
        self.hot_s = self.cold_s = self.wait_s = 0.0

    def timing_ms(self) -> dict | None:
        """Mean per decode token, in ms (None before any)."""
        if self.tokens == 0:
            return None
        return {k: round(getattr(self, k + "_s") * 1000 / self.tokens, 4)
                for k in ("hot", "cold", "wait")}


class HybridFFN(nn.Module):
    def __init__(self, layer: int, ffn_size: int, hot_idx: np.ndarray, cold_idx: np.ndarray,
                 hot: HotFFNWeights | None, cold: SparseFFNWeights | None, worker: CpuWorker,
                 selector: Selector | None = None, cold_file: FileColdFFN | None = None):
        super().__init__()
        self.layer, self.ffn_size = layer, ffn_size
        self.hot_idx, self.cold_idx = hot_idx, cold_idx
        self.hot, self.cold, self.worker = hot, cold, worker
        self.cold_file = cold_file  # the cold side on the file's blocks, instead of bundles
        self.selector = selector
        # Compensation (hidden,) for GLU thresholding: the calibration mean of what the
        # skipped neurons would have added; applied whenever the cold side runs sparse.
        self.bias: torch.Tensor | None = None
        # A profile's input threshold on the down projection (issue 18), for GLU layers with
        # no selector: each token's cold neurons with |act(gate) * up| <= it skip their down
        # row. Applied to every row, as the host's thresholded matmuls are.
        self.down_threshold: float | None = None
        # Quality evaluation: apply the selector row by row in multi-token passes too (a
        # masked dense computation: the same sums as per-token sparse decoding, batched).
        self.sparse_rows = False
        self.counters = LayerCounters()
        self.transfer: TierTransfer | None = None  # made on first use, for the hot side's device
        # The dense module this was split from (set by hybrid.setup; kept on the host only).
        object.__setattr__(self, "source", None)

    @classmethod
    def split(cls, ffn, layer: int, hot_idx: np.ndarray, gpu: torch.device,
              worker: CpuWorker, cold_dtype: str = "fp32",
              selector: Selector | None = None, bundles: bool = True,
              tier: TierChoice | None = None) -> "HybridFFN":
        """Slice one FFN layer into its two homes. `ffn`: a float FeedForward ((in, out)
        weights on the host) or a row source (offload/body/ffn_rows.py: the file's blocks).
        `tier`: the hot rows' formats by file type (None: float32).

        bundles=False: a layer no selector will gate. With nothing hot it gets no cold side
        (it runs its dense twin, `source`, and bundles would be derived bytes never read);
        with cold_dtype "file" its cold side may keep the file's blocks (file_cold.py),
        which compute every cold neuron. A layer a selector gates, now or later, keeps
        bundles, which compute the selected neurons only."""
        rows = as_rows(ffn)
        size = rows.ffn_size
        formats, half = ("fp32", "fp32"), torch.bfloat16
        if tier is not None:
            formats, half = tier.formats(*rows.types()), tier.half
        in_file = file_types(formats[0]) is not None
        hot_idx = np.asarray(hot_idx, dtype=np.int64)
        if in_file:  # the file's down holds neurons in whole blocks: hot sets are groups
            hot_idx = whole_groups(hot_idx, granule(formats), size)
        mask = np.ones(size, dtype=bool)
        mask[hot_idx] = False
        cold_idx = np.flatnonzero(mask).astype(np.int64)
        hot = cold = None
        if hot_idx.size and in_file:
            hot = file_hot_weights(rows, hot_idx, granule(formats), gpu, half)
        elif hot_idx.size:
            gate, up, down_nm = rows.neuron_rows(torch.from_numpy(hot_idx))
            hot = HotFFNWeights.from_rows(gate, up, down_nm, rows.activation, gpu, formats, half)
        cold_file = None
        if cold_idx.size and (bundles or hot_idx.size or selector is not None):
            if cold_dtype == "file" and not bundles and \
                    FileColdFFN.fits(rows, selector is not None):
                cold_file = FileColdFFN(rows, cold_idx)
            else:  # bundles; "file" where the file's blocks cannot serve: int8 ones
                gate, up, down_nm = rows.neuron_rows(torch.from_numpy(cold_idx))
                cold = SparseFFNWeights.from_rows(gate, up, down_nm, rows.activation,
                                                  bundle_dtype(cold_dtype))
        return cls(layer, size, hot_idx, cold_idx, hot, cold, worker, selector, cold_file)

    # -- the per-token path -------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = None
        # a CUDA graph's capture (offload/body/tier_graph.py) runs no token: not counted
        decode = x.shape[0] == 1 and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
        if decode:
            self.counters.tokens += 1
        dense = self.dense_fallback()
        if dense is not None:
            if x.shape[0] == 1:
                self.counters.cold_computed += len(self.cold_idx)
            return dense(x.to("cpu")).to(x.device)
        if self.has_cold_side:
            x_host = x if x.device.type == "cpu" else x.to("cpu")
            active = self.selector(x_host) if self.selector is not None and x.shape[0] == 1 else None
            pending = self.worker.submit(self._cold_side, x_host, active)
        out = None
        if self.hot is not None:
            out = self._hot_side(x, decode)
        if pending is not None:
            t0 = time.perf_counter()
            cold_out = pending.result().to(x.device)
            if decode:
                self.counters.wait_s += time.perf_counter() - t0
            out = cold_out if out is None else out + cold_out
        return out

    def _hot_side(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        t0 = time.perf_counter()
        if x.device == self.hot.device:
            # x is on the tier already (attention runs there): no copies, and the result
            # stays there for the cold side's sum (on CUDA this times the launches only).
            out = hot_ffn(x, self.hot)
        else:
            if self.transfer is None or self.transfer.device != self.hot.device:
                self.transfer = TierTransfer(self.hot.device)
            out = self.transfer.to_host(hot_ffn(self.transfer.to_tier(x), self.hot)).to(x.device)
        if decode:
            self.counters.hot_s += time.perf_counter() - t0
        return out

    def _cold_side(self, x_host: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self._cold_rows(x_host, active)
        if x_host.shape[0] == 1:
            self.counters.cold_s += time.perf_counter() - t0
        return out

    def runs_only_on(self, device: torch.device) -> bool:
        """Whether a call does all its work on `device`, nothing on the host (every neuron
        hot there, no selector): what a CUDA graph of the layer can replay."""
        return (self.hot is not None and self.hot.device == device and not self.has_cold_side
                and self.selector is None)

    @property
    def has_cold_side(self) -> bool:
        return self.cold is not None or self.cold_file is not None

    def _cold_rows(self, x_host: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
        if self.cold_file is not None:
            out, kept = self.cold_file(x_host, self.down_threshold)
            if x_host.shape[0] == 1:
                self.counters.cold_computed += int(kept[0])
            return out
        if active is not None:
            self.counters.cold_computed += int(active.numel())
            return self._compensate(sparse_ffn(x_host, self.cold, active))
        if x_host.shape[0] > 1 and self.sparse_rows and self.selector is not None:
            return self._compensate(masked_rows_ffn(x_host, self.cold, self.selector.mask(x_host)))
        if self.down_threshold is not None:
            out, kept = sparse_ffn_thresholded(x_host, self.cold, self.down_threshold)
            if x_host.shape[0] == 1:
                self.counters.cold_computed += int(kept[0])
            return out
        if x_host.shape[0] == 1:
            self.counters.cold_computed += len(self.cold_idx)
        return sparse_ffn(x_host, self.cold)  # no index list: every cold neuron

    def _compensate(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias

    def dense_fallback(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The dense twin to run instead (`source`: the float FeedForward, or the file's
        blocks), when this layer computes every neuron on the host anyway (nothing hot, no
        selector): it has a faster dense path (the Q8_0 body's, or the file's blocks) than
        the neuron bundles."""
        if self.hot is None and self.selector is None:
            return self.source
        return None

    # -- reporting ----------------------------------------------------------------------
    def hot_fraction(self) -> float:
        return len(self.hot_idx) / self.ffn_size

    def computed_fraction(self) -> float | None:
        """Fraction of the layer's neurons computed per decode token (hot ones always are)."""
        c = self.counters
        if c.tokens == 0:
            return None
        return (len(self.hot_idx) + c.cold_computed / c.tokens) / self.ffn_size

    def gpu_bytes(self) -> int:
        return 0 if self.hot is None else self.hot.nbytes()

    def host_bytes(self) -> int:
        if self.cold_file is not None:
            return self.cold_file.nbytes
        return 0 if self.cold is None else self.cold.nbytes()

    def down_nm_bytes(self) -> int:
        """Bytes of the neuron-major down rows both sides hold: derived from the file's
        (hidden, ffn) down, not a view of it (the hot tier's down in its format, the cold
        bundles' int8 rows and scales or fp32 rows)."""
        hot = 0 if self.hot is None else self.hot.down_nbytes()
        cold = 0 if self.cold is None else self.cold.nbytes() // self.cold.nrows
        if self.cold_file is not None:
            cold = self.cold_file.down.nbytes  # the file's down as tiles, hot columns too
        return hot + cold


def whole_groups(hot_idx: np.ndarray, group: int, size: int) -> np.ndarray:
    """The hot set a plan asked for (any neurons) as whole groups of `group` consecutive
    neurons (the file's down blocks): len(hot_idx) // group groups, those holding most of
    the asked-for neurons first (ties: lower index), sorted. A granule-aligned ask of whole
    groups comes back as is."""
    n_groups = len(hot_idx) // group
    if n_groups == 0:
        return np.zeros(0, dtype=np.int64)
    asked = np.bincount(hot_idx // group, minlength=size // group)
    order = np.lexsort((np.arange(len(asked)), -asked))[:n_groups]
    chosen = np.sort(order)
    return (chosen[:, None] * group + np.arange(group)[None, :]).reshape(-1).astype(np.int64)


def file_hot_weights(rows, hot_idx: np.ndarray, group: int, gpu: torch.device,
                     half: torch.dtype) -> HotFFNWeights:
    """The hot neurons (whole groups) in the file's blocks on the tier: gate/up their rows,
    down their blocks; a layer hot in full keeps the file's tensors themselves (on a CPU
    tier the very same bytes)."""
    if len(hot_idx) == rows.ffn_size:
        return HotFFNWeights.from_file(rows.gate_up, rows.down, rows.activation, gpu, half)
    idx = torch.from_numpy(hot_idx)
    groups = torch.from_numpy(np.unique(hot_idx // group))
    return HotFFNWeights.from_file([t.select_rows(idx) for t in rows.gate_up],
                                   down_columns(rows.down, groups), rows.activation, gpu, half)


def masked_rows_ffn(x: torch.Tensor, w: SparseFFNWeights, mask: torch.Tensor) -> torch.Tensor:
    """Every row of x (T, hidden) through the neurons its own mask (T, n) keeps: the result
    per-token sparse decoding gives, computed as one masked dense pass (for evaluation)."""
    rows = {}
    for name in ("gate", "up", "down_nm"):
        t = getattr(w, name)
        scale = getattr(w, name.replace("_nm", "") + "_scale")
        rows[name] = None if t is None else (t.float() * scale[:, None] if scale is not None else t)
    gate = None if rows["gate"] is None else x @ rows["gate"].t()
    h = activate(w.activation, gate, x @ rows["up"].t()) * mask
    return h @ rows["down_nm"]
