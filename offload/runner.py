"""Batch-1 execution of one sequence: chunked prefill, then one token per decode step.

The runner owns the KV cache and remembers which token ids it holds, so a new request that
extends the previous one (the next chat turn) prefills only the new tokens.
"""

from __future__ import annotations

import torch

from ember.models.errors import ConfigError
from ember.models.transformer import Transformer

DEFAULT_PREFILL_CHUNK = 512


class Runner:
    def __init__(self, model: Transformer, n_ctx: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if n_ctx > model.cfg.context_length:
            raise ConfigError(f"context size {n_ctx} exceeds the model's maximum "
                              f"{model.cfg.context_length}")
        self.model, self.n_ctx, self.prefill_chunk = model, n_ctx, prefill_chunk
        self.cache = model.new_cache(n_ctx)
        self.tokens: list[int] = []  # ids whose K/V the cache holds, in order

    def reset(self) -> None:
        """Forget the cached sequence (the next prefill starts from scratch)."""
        self.cache.truncate(0)
        self.tokens = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Make the cache hold exactly `ids`; returns the logits after the last one (vocab,).

        Reuses the longest common prefix with what the cache already holds.
        """
        if not ids:
            raise ConfigError("the prompt is empty")
        if len(ids) > self.n_ctx:
            raise ConfigError(f"the prompt has {len(ids)} tokens but the context holds "
                              f"{self.n_ctx}; shorten it or raise --ctx-size")
        # Keep at least the last token to recompute: its logits are what we return.
        keep = min(_common_prefix(self.tokens, ids), len(ids) - 1)
        self.cache.truncate(keep)
        self.tokens = self.tokens[:keep]
        hidden = None
        for lo in range(keep, len(ids), self.prefill_chunk):
            chunk = ids[lo: lo + self.prefill_chunk]
            hidden = self.model.hidden(self._tensor(chunk), self.cache)
            self.tokens.extend(chunk)
        return self.model.logits(hidden[-1:])[0]

    def decode(self, token: int) -> torch.Tensor:
        """Append one token; returns the logits for the next position (vocab,)."""
        if len(self.tokens) >= self.n_ctx:
            raise ConfigError(f"the context is full ({self.n_ctx} tokens)")
        hidden = self.model.hidden(self._tensor([token]), self.cache)
        self.tokens.append(token)
        return self.model.logits(hidden)[0]

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
