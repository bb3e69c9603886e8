"""Batched forward passes over long token sequences, and teacher-forced scoring.

Profiling runs thousands of calibration tokens through the model; one forward of a few hundred
tokens over a contiguous KV cache is far cheaper than decoding them one at a time. A sequence
is cut into segments that each start with BOS and run in a single `Transformer.hidden` call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ember.models.support.errors import ConfigError
from ember.models.transformer import Transformer

LOGIT_ROWS = 128  # rows of (rows, vocab) logits alive at once (128 x 262k x 4 B = 134 MB)


def segments(ids: list[int], length: int, bos_id: int | None) -> list[torch.Tensor]:
    """Cut ids into (BOS +) consecutive pieces of at most `length` tokens in all."""
    span = length - (bos_id is not None)
    if span < 2:
        raise ConfigError(f"segment length must be at least 3 tokens, got {length}")
    out = []
    for begin in range(0, len(ids), span):
        piece = ids[begin: begin + span]
        if len(piece) < 2:  # a lone trailing token predicts nothing
            continue
        out.append(torch.tensor(([bos_id] if bos_id is not None else []) + piece, dtype=torch.long))
    return out


def check_length(model: Transformer, length: int) -> None:
    if not 3 <= length <= model.cfg.context_length:
        raise ConfigError(f"segment length {length} must be in 3..{model.cfg.context_length} "
                          f"(the model's context)")


@torch.inference_mode()
def run(model: Transformer, ids: list[int], length: int, bos_id: int | None) -> int:
    """Forward every segment (for the side effects of swapped FFNs); returns tokens run."""
    check_length(model, length)
    cache, n = model.new_cache(length), 0
    for seg in segments(ids, length, bos_id):
        cache.truncate(0)
        model.hidden(seg.to(model.device), cache)
        n += len(seg)
    return n


@dataclass
class Scores:
    """Teacher-forced next-token results over every scored position."""

    tokens: int
    nll: float  # summed, nats
    argmax: torch.Tensor  # (tokens,) the model's top-1 prediction at each scored position

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def agreement(self, other: "Scores") -> float:
        """Fraction of positions where both runs predict the same top-1 token."""
        if other.tokens != self.tokens:
            raise ValueError("scores over different token sets cannot be compared")
        return float((self.argmax == other.argmax).float().mean()) if self.tokens else float("nan")


@torch.inference_mode()
def score(model: Transformer, ids: list[int], length: int, bos_id: int | None) -> Scores:
    """NLL and top-1 predictions of every token after the first of each segment."""
    check_length(model, length)
    cache, nll, tops = model.new_cache(length), 0.0, []
    for seg in segments(ids, length, bos_id):
        cache.truncate(0)
        seg = seg.to(model.device)
        hidden = model.hidden(seg, cache)[:-1]  # position t predicts token t + 1
        for c in range(0, hidden.shape[0], LOGIT_ROWS):
            logp = torch.log_softmax(model.logits(hidden[c: c + LOGIT_ROWS]), dim=-1)
            targets = seg[c + 1: c + 1 + logp.shape[0]]
            nll -= float(logp.gather(1, targets[:, None]).sum())
            tops.append(logp.argmax(-1).cpu())
    argmax = torch.cat(tops) if tops else torch.empty(0, dtype=torch.long)
    return Scores(int(argmax.numel()), nll, argmax)
