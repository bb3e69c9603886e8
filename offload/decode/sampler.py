"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The order follows llama.cpp's default chain so the same settings mean the same thing in both:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature 0 is greedy.
A seed makes the draws reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ember.kernels import fused_ops
from ember.models.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min-p must be in [0, 1) (0 disables it), got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise ConfigError(f"repeat penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ConfigError(f"repeat-last-n must be >= 0, got {self.repeat_last_n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """Draws token ids from logits under one `SamplingParams`, with its own random stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Sample from `logits` (vocab,); `history` is the context so far (for the penalty)."""
        p = self.params
        logits = apply_repeat_penalty(logits.float(), history[-p.repeat_last_n:] if p.repeat_last_n else (),
                                      p.repeat_penalty)
        if p.greedy:
            return fused_ops.argmax(logits)
        ids, probs = filter_candidates(logits, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(torch.log(probs) / p.temperature, dim=-1)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])


def apply_repeat_penalty(logits: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Make recently seen tokens less likely: positive logits divided, negative multiplied."""
    if penalty == 1.0 or not recent:
        return logits
    logits = logits.clone()
    idx = torch.tensor(sorted(set(recent)), dtype=torch.long)
    seen = logits[idx]
    logits[idx] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def filter_candidates(logits: torch.Tensor, top_k: int, top_p: float, min_p: float):
    """Candidate ids and their renormalized probabilities (at temperature 1) after the filters.

    Returns (ids, probs), sorted by decreasing probability; at least one candidate survives.
    """
    k = logits.shape[-1] if top_k == 0 else min(top_k, logits.shape[-1])
    values, ids = fused_ops.top_k(logits, k)  # sorted, largest first
    probs = torch.softmax(values, dim=-1)
    keep = probs.shape[0]
    if top_p < 1.0:
        # Smallest prefix whose mass reaches top_p.
        cumulative = torch.cumsum(probs, dim=-1)
        keep = min(keep, int(torch.searchsorted(cumulative, torch.tensor([top_p]))[0]) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int((probs[:keep] >= min_p * probs[0]).sum())))
    probs = probs[:keep]
    return ids[:keep], probs / probs.sum()
