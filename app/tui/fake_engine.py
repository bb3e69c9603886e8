"""A stand-in engine for tests and demos: streams scripted replies with small delays.

Deterministic and fast, with the knobs the tests need: per-token delay, a gate that holds
loading until the test opens it, an error to raise instead of replying, and a record of every
conversation it was asked to answer.
"""

from __future__ import annotations

import threading
import time

from ember.models.errors import EmberError
from ember.offload.events import DoneEvent, Timings, TokenEvent


class FakeEngine:
    def __init__(self, replies: list[str] | None = None, token_delay: float = 0.005,
                 load_gate: threading.Event | None = None, n_ctx: int = 4096,
                 name: str = "fake model"):
        self.name = name
        self.replies = list(replies or ["Hello! How can I help?"])
        self.token_delay = token_delay
        self.load_gate = load_gate  # load() waits until it is set (None: loads at once)
        self.fail_next: EmberError | None = None  # raised by the next stream_reply
        self.requests: list[list] = []  # the messages of each stream_reply call
        self.sessions: list[str] = []  # the session (conversation) of each call
        self.last_settings = None  # the ChatSettings of the latest call
        self.loaded = threading.Event()
        self._n_ctx = n_ctx

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def load(self) -> None:
        if self.load_gate is not None:
            self.load_gate.wait(timeout=30)
        self.loaded.set()

    def stream_reply(self, messages, settings, cancel, session="default"):
        self.requests.append(list(messages))
        self.sessions.append(session)
        self.last_settings = settings
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        reply = self.replies[(len(self.requests) - 1) % len(self.replies)]
        # "Tokens" are whitespace-separated words with their leading space, capped like a model.
        tokens = [w if i == 0 else " " + w for i, w in enumerate(reply.split(" "))]
        tokens = tokens[:settings.max_tokens]
        prompt_tokens = sum(len(m.content.split()) + 4 for m in messages)
        start = time.perf_counter()
        timings = Timings(prompt_tokens=prompt_tokens)
        text, finish = "", "eos" if len(tokens) < settings.max_tokens else "length"
        for i, token in enumerate(tokens):
            # Wait on the event, not time.sleep, so a cancel wakes us at once.
            if cancel.wait(self.token_delay):
                finish = "cancelled"
                break
            if i == 0:
                timings.ttft_s = time.perf_counter() - start
            text += token
            timings.generated_tokens += 1
            yield TokenEvent(i, token)
        timings.decode_s = time.perf_counter() - start - timings.ttft_s
        yield DoneEvent(finish, text, list(range(timings.generated_tokens)), [], timings)
