"""A reply as events: the decode loop's token ids turned into text deltas (never half a
UTF-8 character, control and image-marker tokens silent), cut at stop strings, timed."""

from __future__ import annotations

import time
from typing import Iterator

from ember.models.tokenizer import StreamDecoder

from ..decode.events import DoneEvent, Timings, TokenEvent
from ..decode.stopping import StopStrings


def reply_events(tokens: Iterator[tuple[int | None, str | None]], decoder: StreamDecoder,
                 stops: StopStrings, hidden_ids: set[int], prompt_ids: list[int],
                 timings: Timings, logprobs: dict | None = None) -> Iterator[TokenEvent | DoneEvent]:
    """A TokenEvent per token of `tokens` (what `decode_loop` yields), then one DoneEvent
    with the loop's finish reason, or "stop" when a stop string ends the reply first.
    `logprobs`: the sampler's, by position; each token's goes on its event."""
    generated: list[int] = []
    text, finish = "", None
    start = time.perf_counter()
    for token, reason in tokens:
        if reason is not None:
            finish = reason
            break
        now = time.perf_counter()
        if not generated:
            timings.ttft_s = now - start
        timings.decode_s = now - start - timings.ttft_s
        position = len(prompt_ids) + len(generated)
        generated.append(token)
        delta = stops.push("" if token in hidden_ids else decoder.push(token))
        text += delta
        yield TokenEvent(token, delta, None if logprobs is None else logprobs.pop(position, None))
        if stops.stopped:
            finish = "stop"
            break
    if finish != "stop":
        tail = stops.push(decoder.flush()) + stops.flush()
        if tail:
            text += tail
            yield TokenEvent(None, tail)
    timings.generated_tokens = len(generated)
    yield DoneEvent(finish, text, generated, list(prompt_ids), timings)
