"""The body's pass one layer at a time, so that a probe changing layer i re-runs only layers
i.. (on the default model's 18 layers, half the body on average).

Each layer gets a one-layer C++ DecoderStep (kernels/decoder_step.py) running the same
attention and FFN code as the whole body's step, so the chain gives the dense pass bit for bit
and keeps what enters each layer; a slot's threshold set on layer i's step applies there
alone. A FileBlocksModel's own step is left as it was (its input thresholds included).
"""

from __future__ import annotations

import torch

from ember.kernels import decoder_step
from ember.kernels.fused_ops import rms_norm

from ..body.input_sparsity import SLOTS, InputSparsity
from ..body.layer_runs import PassRows


class LayerChain:
    def __init__(self, model, runtime: InputSparsity):
        """`model`: a FileBlocksModel; `runtime`: its InputSparsity, whose input-major tiles the
        probes read (derived here for every slot not yet tiled)."""
        self.model, self.runtime = model, runtime
        self.steps = [decoder_step.decoder_step([layer]).__self__ for layer in model.layers]
        self._counts = torch.zeros(2, dtype=torch.int64)  # the probes' kept/seen (unread)

    @torch.inference_mode()
    def dense_inputs(self, seg: torch.Tensor, cache) -> list[torch.Tensor]:
        """Run `seg` (T,) through every layer: what enters each layer, then the last layer's
        output (n_layers + 1 tensors of (T, hidden))."""
        x = self.model.embed(seg)
        xs = [x]
        for first in range(len(self.steps)):
            x = self._run(first, first + 1, x, cache)
            xs.append(x)
        return xs

    @torch.inference_mode()
    def hidden_from(self, first: int, x: torch.Tensor, cache) -> torch.Tensor:
        """The final-normed hidden states (T, hidden) of a pass whose layer `first` gets `x`
        (what dense_inputs kept for it): layers first.. run again."""
        return self.final(self._run(first, len(self.steps), x, cache))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output normed as the model's pass returns it."""
        return rms_norm(x, self.model.output_norm, self.model.cfg.rms_eps)

    def threshold(self, layer: int, slot: str, value: float | None) -> None:
        """Threshold one slot of one layer's step (None: back to the file's blocks)."""
        s = SLOTS.index(slot)
        if value is None:
            self.steps[layer].set_input_sparse(0, s, [], [], [], -1.0, self._counts)
            return
        tiles = self.runtime.tiles(layer, slot)
        self.steps[layer].set_input_sparse(0, s, [w.packed for w in tiles],
                                           [w.qtype for w in tiles],
                                           [w.shape[0] for w in tiles], float(value),
                                           self._counts)

    def _run(self, first: int, end: int, x: torch.Tensor, cache) -> torch.Tensor:
        T = x.shape[0]
        cache.truncate(0)
        cache.reserve(T)
        # each layer's pool rows and rotary tables, as the model's own pass computes them
        m = self.model
        slots, positions, cos, sin = PassRows(0, T, cache, None, m.rotary, m.windows).host(
            list(range(len(self.steps))))
        pools = cache.layer_pools()
        for i in range(first, end):
            x = self.steps[i].run(x, *pools[i], slots[i: i + 1], positions, cos[i: i + 1],
                                  sin[i: i + 1])
        return x

