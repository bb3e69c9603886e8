"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The order follows llama.cpp's default chain so the same settings mean the same thing in both:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature 0 is greedy.
A seed makes the draws reproducible.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from ember.kernels import fused_ops

from ..options.sampling import SamplingParams


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
