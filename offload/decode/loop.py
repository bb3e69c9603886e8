"""The decode loop plain and speculative decoding share: prefill, then steps until a stop.

A step produces the target's next tokens after the committed history. `PlainStep` decodes
one token and samples it; the speculative step (`speculative/verify.py`) drafts a token tree,
verifies it, accepts and commits, and may return several tokens (with nothing drafted it is
a `PlainStep`). Whatever the step, the loop alone times the prefill and decides when
generation ends, checking before each token is released, in this order: cancel, end of
sequence, max tokens (after it), and a full context (before the next step).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Protocol

import torch

from ember.models.support.errors import ConfigError

from .events import Timings
from .runner import Runner
from .sampler import Sampler


class Step(Protocol):
    def first(self, logits: torch.Tensor, history: list[int]) -> list[int]:
        """The first generated token(s), from the prefill's `logits` after `history` (the
        prompt, which the session now holds)."""

    def next(self, history: list[int], remaining: int) -> list[int]:
        """The target's tokens after `history`, whose last token the session does not hold
        yet: at least one and at most `remaining`. Afterwards the session holds `history`
        and every returned token but the last."""


class PlainStep:
    """One decode pass and one draw: the step of plain decoding."""

    def __init__(self, runner: Runner, session: str, sampler: Sampler):
        self.runner, self.session, self.sampler = runner, session, sampler

    def first(self, logits: torch.Tensor, history: list[int]) -> list[int]:
        return [self.sampler(logits, history)]

    def next(self, history: list[int], remaining: int) -> list[int]:
        return [self.sampler(self.runner.decode(self.session, history[-1]), history)]


def decode_loop(runner: Runner, session: str, step: Step, prompt_ids: list[int], max_tokens: int,
                stop_ids: set[int], timings: Timings,
                cancel: threading.Event | None = None) -> Iterator[tuple[int | None, str | None]]:
    """Prefill `prompt_ids` into `session`, then yield (token, None) per generated token and
    last (None, reason): "cancelled", "eos" (a token of `stop_ids`, not yielded), "length"
    (`max_tokens` yielded) or "context" (the session holds the whole context).

    Sets `timings.prefill_s` and `timings.cached_tokens`. `cancel` is checked before each prompt chunk and each token.
    """
    if max_tokens < 1:
        raise ConfigError(f"max tokens must be at least 1, got {max_tokens}")
    t0 = time.perf_counter()
    logits = runner.prefill(session, list(prompt_ids), cancel)
    timings.prefill_s = time.perf_counter() - t0
    timings.cached_tokens = len(prompt_ids) - runner.last_prefill_tokens
    if logits is None:  # cancelled between prompt chunks
        yield None, "cancelled"
        return
    history = list(prompt_ids)
    pending = step.first(logits, history)
    while True:
        token = pending.pop(0)
        if cancel is not None and cancel.is_set():
            yield None, "cancelled"
            return
        if token in stop_ids:
            yield None, "eos"
            return
        history.append(token)
        yield token, None
        generated = len(history) - len(prompt_ids)
        if generated == max_tokens:
            yield None, "length"
            return
        if pending:  # a speculative step's accepted tokens, already committed
            continue
        if len(runner.tokens(session)) >= runner.n_ctx:
            yield None, "context"
            return
        pending = step.next(history, max_tokens - generated)
