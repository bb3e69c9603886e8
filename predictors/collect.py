"""Run a model over calibration tokens and record per-layer FFN activation statistics."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.support.errors import ConfigError
from ember.models.transformer import Transformer

from .ffn_swap import intermediate, swapped_ffns
from .passes import check_length, segments
from .stats import Collection, LayerStats, Reservoir, bytes_per_token, is_active

DEFAULT_SAMPLE_BYTES = 256 << 20


class _Batch:
    """Random sampling keys for the tokens of the segment being run, shared by all layers,
    so every layer samples the same tokens."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.keys = torch.empty(0)
        self.skip = 0  # leading positions to leave out (the BOS, whose activations are outliers)

    def start(self, n: int, skip: int) -> None:
        self.keys, self.skip = torch.rand(n - skip, generator=self.generator), skip


class _RecordingFFN(nn.Module):
    """Computes the FFN as usual, recording |h|; with `sparse`, zeroes the inactive entries of h
    so later layers see the inputs the sparse model will give them."""

    def __init__(self, ffn: nn.Module, stats: LayerStats, sample: Reservoir, batch: _Batch,
                 sparse: bool):
        super().__init__()
        self.ffn, self.stats, self.sample = ffn, stats, sample
        self.batch, self.sparse = batch, sparse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = intermediate(self.ffn, x)
        habs = h.abs()
        s = self.batch.skip
        self.stats.update(habs[s:])
        self.sample.add(self.batch.keys, x[s:], habs[s:])
        if self.sparse and self.stats.threshold > 0:
            h = h * is_active(habs, self.stats.threshold)
        return h @ self.ffn.down


@torch.inference_mode()
def collect(model: Transformer, ids: list[int], bos_id: int | None,
            thresholds: list[float] | None = None, sample_bytes: int = DEFAULT_SAMPLE_BYTES,
            length: int = 512, sparse: bool = False, seed: int = 0,
            progress=None) -> Collection:
    """Statistics of every layer's FFN neurons over `ids`, plus a bounded token sample.

    Args:
        ids: calibration token ids (no BOS); run in segments of `length` tokens, each after BOS.
        thresholds: per-layer relative |h| thresholds defining "active" (`stats.is_active`;
            default 0: h != 0).
        sample_bytes: cap on the kept sample of (x, |h|) rows, all layers together.
        sparse: zero inactive entries of h while running (collect from the thresholded model).
        progress: optional callable(fraction, stage), called after each segment.
    Returns:
        a `Collection`; the model's FFN modules are restored before returning.
    """
    cfg = model.cfg
    check_length(model, length)
    thresholds = [0.0] * cfg.n_layers if thresholds is None else [float(t) for t in thresholds]
    if len(thresholds) != cfg.n_layers:
        raise ConfigError(f"{len(thresholds)} thresholds given for {cfg.n_layers} layers")
    if any(t < 0 for t in thresholds):
        raise ConfigError("activation thresholds must be >= 0")
    capacity = sample_bytes // (cfg.n_layers * bytes_per_token(cfg.hidden_size, cfg.ffn_size))
    if capacity < 1:
        raise ConfigError(f"sample_bytes={sample_bytes} holds no token; give at least "
                          f"{cfg.n_layers * bytes_per_token(cfg.hidden_size, cfg.ffn_size)}")
    stats = [LayerStats(t) for t in thresholds]
    samples = [Reservoir(capacity) for _ in thresholds]
    batch = _Batch(seed)

    def make(i, ffn):
        return _RecordingFFN(ffn, stats[i], samples[i], batch, sparse)

    cache = model.new_cache(length)
    with swapped_ffns(model, make):
        segs = segments(ids, length, bos_id)
        for i, seg in enumerate(segs):
            cache.truncate(0)
            batch.start(len(seg), 1 if bos_id is not None else 0)
            model.hidden(seg.to(model.device), cache)
            if progress is not None:
                progress((i + 1) / len(segs), f"segment {i + 1} of {len(segs)}")
    return Collection(stats, samples)
