"""One-row calls on the GPU tier replayed from a CUDA graph (set EMBER_CUDA_GRAPHS=1).

A decoded token runs each tier FFN as dozens of small kernels (a tile of the file's blocks
decoded, converted, multiplied; the activation; down): PyTorch launches each at 5-10 us, which
at a 7B's 32 layers is most of a token on a fast card (llama.cpp replays CUDA graphs). A
`GraphedRows` captures such a function once for one row, x (1, width) -> (1, width), on a side
stream, and replays it for every later row: same kernels, same inputs, the same bits as the
eager call. Prefill chunks and tree rows (T > 1) run eagerly. The capture needs fixed shapes
and no host work inside, so only whole functions of the tier's own tensors are graphed
(kernels/hot_ffn.py:hot_ffn), not attention (its keys grow every token) nor a split layer
(its cold side runs on a CPU thread).

Off by default: the graphs' memory pool and capture time are not charged by the plan yet.
`graphed` returns the function itself where graphs are off or there is no CUDA device.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

ENV = "EMBER_CUDA_GRAPHS"


def available() -> bool:
    """Whether one-row tier calls are graphed: asked for (EMBER_CUDA_GRAPHS=1) and CUDA here."""
    return os.environ.get(ENV) == "1" and torch.cuda.is_available()


class GraphedRows:
    """`fn` (x (T, width) on `device` -> (T, width)) with its one-row calls replayed from a
    graph captured at the first one."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
        self.fn, self.device = fn, torch.device(device)
        self.graph = None
        self.x = self.out = None  # the graph's static input and output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1 or x.device != self.device:
            return self.fn(x)
        if self.graph is None or x.dtype != self.x.dtype or x.shape != self.x.shape:
            self._capture(x)
        self.x.copy_(x)
        self.graph.replay()
        return self.out.clone()

    def _capture(self, x: torch.Tensor) -> None:
        self.x = x.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: workspaces allocated outside the graph
            for _ in range(2):
                self.fn(self.x)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn(self.x)


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
    """`fn` with its one-row calls graphed on `device` where `available()` and the device is
    CUDA; else `fn` itself."""
    if available() and torch.device(device).type == "cuda":
        return GraphedRows(fn, device)
    return fn
