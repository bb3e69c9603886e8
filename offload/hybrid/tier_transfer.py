"""Activations to the GPU tier and results back, once per split layer.

On CUDA the host side of each copy is a pinned buffer (DMA straight from it, no pageable
bounce) and both copies are non-blocking on the current stream; the only wait is one
synchronisation per layer, on the result's copy, since the host adds it to the cold side's
result next. On any other tier device (the CPU in tests) copies are plain `.to()`; the hot
side's arithmetic is the same either way.
"""

from __future__ import annotations

import torch


class TierTransfer:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pinned: dict[tuple, torch.Tensor] = {}  # (direction, shape, dtype) -> buffer
        self.syncs = 0  # synchronisations so far (one per layer and token on CUDA)

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._pinned.get(key)
        if buf is None:
            buf = self._pinned[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf

    def to_tier(self, x: torch.Tensor) -> torch.Tensor:
        """Host x -> the tier. On CUDA the pinned input buffer is reused next layer only
        after this layer's `to_host` synchronised, which the copy precedes on the stream."""
        if not self.cuda:
            return x.to(self.device)
        buf = self._buffer(("in", tuple(x.shape), x.dtype), x)
        buf.copy_(x)
        return buf.to(self.device, non_blocking=True)

    def to_host(self, y: torch.Tensor) -> torch.Tensor:
        """The tier's result -> a host tensor of its own (the pinned buffer is reused)."""
        if not self.cuda:
            return y.to("cpu")
        buf = self._buffer(("out", tuple(y.shape), y.dtype), y)
        buf.copy_(y, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        self.syncs += 1
        return buf.clone()
