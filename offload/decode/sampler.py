"""Next-token sampling: logit bias, penalties, a grammar's mask, then greedy or a draw.

The order follows llama.cpp's default chain so the same settings mean the same thing in both:
logit bias -> repetition penalty -> frequency/presence penalties -> (grammar mask) -> top-k
-> top-p -> min-p -> temperature -> draw. Temperature 0 is greedy. A seed makes the draws
reproducible.

Everything before top-k depends only on the logits and the history, never on what else is in
the batch or on which step draws: speculative verification calls the same sampler at every
node with that node's history, so it draws what plain decoding would (lossless). The
log-probabilities reported (`logprobs`) are of that processed distribution at temperature 1,
before the truncating filters (vLLM's default: otherwise most top_logprobs would be -inf).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ember.kernels import fused_ops

from ..options.sampling import SamplingParams


class Constraint(Protocol):
    """What a grammar does in the sampler (`decode.grammar.GrammarConstraint`)."""

    def apply(self, logits: torch.Tensor, generated: Sequence[int]) -> None:
        """Set, in place, the logits of the tokens that may not follow `generated` to -inf."""


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the likeliest tokens' (id, log-probability),
    most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """Draws token ids from logits under one `SamplingParams`, with its own random stream.

    `prompt_len`: where the generated tokens start in the histories it is given (the
    penalties and the grammar read those). With `params.logprobs` set, each draw's
    `TokenLogprob` is kept in `logprobs` under the position the token takes in the sequence.
    """

    def __init__(self, params: SamplingParams, prompt_len: int = 0,
                 constraint: Constraint | None = None):
        self.params, self.prompt_len, self.constraint = params, prompt_len, constraint
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs: dict[int, TokenLogprob] = {}

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Sample from `logits` (vocab,); `history` is the context so far."""
        p = self.params
        logits = self.process(logits, history)
        if p.greedy:
            token = fused_ops.argmax(logits)
        else:
            ids, probs = filter_candidates(logits, p.top_k, p.top_p, p.min_p)
            probs = torch.softmax(torch.log(probs) / p.temperature, dim=-1)
            token = int(ids[torch.multinomial(probs, 1, generator=self.generator)])
        if p.logprobs is not None:
            self.logprobs[len(history)] = token_logprob(logits, token, p.logprobs)
        return token

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The logits the filters and the draw see, as float32; the caller's are never
        written (a verification's rows are views of one tensor). Copied once, and only when
        a step below writes in place: plain greedy decoding reads them as they are."""
        p = self.params
        penalties = bool(p.frequency_penalty or p.presence_penalty)
        logits = logits.float()
        if p.logit_bias or penalties or self.constraint is not None:
            logits = logits.clone()
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype)
        recent = history[-p.repeat_last_n:] if p.repeat_last_n else ()
        logits = apply_repeat_penalty(logits, recent, p.repeat_penalty)  # copies if it writes
        if penalties or self.constraint is not None:
            generated = history[self.prompt_len:]
            if penalties:
                apply_openai_penalties(logits, generated, p.frequency_penalty,
                                       p.presence_penalty)
            if self.constraint is not None:
                self.constraint.apply(logits, generated)
        return logits


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under softmax(logits), and the `top` likeliest tokens'."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    values, ids = torch.topk(logprobs, top) if top else (torch.empty(0), torch.empty(0))
    return TokenLogprob(float(logprobs[token]),
                        tuple(zip(map(int, ids.tolist()), values.tolist())))


def apply_repeat_penalty(logits: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Make recently seen tokens less likely: positive logits divided, negative multiplied."""
    if penalty == 1.0 or not recent:
        return logits
    logits = logits.clone()
    idx = torch.tensor(sorted(set(recent)), dtype=torch.long)
    seen = logits[idx]
    logits[idx] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def apply_openai_penalties(logits: torch.Tensor, generated: Sequence[int], frequency: float,
                           presence: float) -> None:
    """In place: each generated token's logit lowered by count * frequency + presence."""
    counts = Counter(generated)
    if not counts:
        return
    idx = torch.tensor(list(counts), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    logits[idx] -= n * frequency + presence


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
