"""Temporary stand-ins for a model's `FeedForward` modules, restored on exit.

Statistics collection and sparsity calibration both need the FFN's intermediate activation h,
which a forward hook cannot see (it gets x and the FFN's output only). So the blocks' `ffn`
attributes are swapped for wrappers that compute h themselves, and put back afterwards even
when the body raises. The model's own code is never changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ember.models.transformer import Transformer, activate


def intermediate(ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """h = act(x @ gate, x @ up) of a `FeedForward` for x (T, hidden) -> (T, ffn)."""
    gate = x @ ffn.gate if ffn.gate is not None else None
    return activate(ffn.activation, gate, x @ ffn.up)


@contextmanager
def swapped_ffns(model: Transformer, make: Callable[[int, nn.Module], nn.Module],
                 layers: list[int] | None = None) -> Iterator[list[nn.Module]]:
    """Replace `blocks[i].ffn` by `make(i, original)` for each layer; yields the wrappers."""
    layers = list(range(len(model.blocks))) if layers is None else layers
    originals = {i: model.blocks[i].ffn for i in layers}
    try:
        wrappers = []
        for i in layers:
            wrapper = make(i, originals[i])
            model.blocks[i].ffn = wrapper
            wrappers.append(wrapper)
        yield wrappers
    finally:
        for i, ffn in originals.items():
            model.blocks[i].ffn = ffn
