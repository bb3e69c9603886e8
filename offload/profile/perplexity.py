"""Perplexity of a token sequence, windowed with a stride when it exceeds the context.

Each window starts with BOS followed by up to (window - 1) text tokens; only tokens not scored
by an earlier window are scored, so every token after the first is scored exactly once, with
as much left context as the window allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ember.models.support.errors import ConfigError
from ember.models.transformer import Transformer

LOGIT_CHUNK = 256  # rows of (rows, vocab) logits alive at once: 256 x 262k x 4 B = 268 MB


@dataclass
class PerplexityResult:
    tokens: int  # tokens scored
    nll: float  # summed negative log-likelihood (nats)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def windows(n_text: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) over text positions; window counts the BOS slot."""
    span = window - 1
    if span < 2:
        raise ConfigError("the perplexity window must hold at least 3 tokens")
    if not 0 < stride <= span:
        raise ConfigError(f"stride must be in 1..{span}, got {stride}")
    out, scored = [], 0
    begin = 0
    while scored < n_text:
        end = min(begin + span, n_text)
        out.append((begin, end, scored))
        scored = end
        if end == n_text:
            break
        begin += stride
    return out


@torch.inference_mode()
def perplexity(model: Transformer, text_ids: list[int], bos_id: int, window: int,
               stride: int | None = None) -> PerplexityResult:
    """Score `text_ids` (without BOS). The first text token is scored given BOS alone."""
    stride = stride or max(1, (window - 1) // 2)
    total = PerplexityResult(0, 0.0)
    cache = model.new_cache(window)
    for begin, end, first in windows(len(text_ids), window, stride):
        cache.truncate(0)
        ids = torch.tensor([bos_id] + text_ids[begin:end], dtype=torch.long,
                           device=model.device)
        # Positions in `ids` whose next-token prediction we score: text tokens first..end-1.
        lo = first - begin  # index in ids of the token *before* the first scored one
        for c in range(0, len(ids), LOGIT_CHUNK):
            hidden = model.hidden(ids[c: c + LOGIT_CHUNK], cache)
            rows = torch.arange(c, c + hidden.shape[0], device=ids.device)
            keep = (rows >= lo) & (rows < len(ids) - 1)
            if not keep.any():
                continue
            logp = torch.log_softmax(model.logits(hidden[keep]), dim=-1)
            targets = ids[rows[keep] + 1]
            total.nll -= float(logp.gather(1, targets[:, None]).sum())
            total.tokens += int(keep.sum())
    return total
