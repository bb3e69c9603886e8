"""The narrow interface between the chat App and an engine.

The App only ever calls `load()` once and then `stream_reply()` and `stats()`, always from one
worker thread at a time (the Engine is not thread-safe). `stream_reply` yields the engine's own
events: a `TokenEvent` per text delta and one final `DoneEvent` with the finish reason and
timings; `stats()` after each reply says where the KV cache stands.
`FakeEngine` (fake_engine.py) implements the same interface for tests.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, Protocol

from ember.models.chat_format import ChatMessage
from ember.offload.events import DoneEvent, TokenEvent

from .settings import ChatSettings


class EnginePort(Protocol):
    name: str  # shown in the status bar

    @property
    def n_ctx(self) -> int:
        """Context window in tokens (valid after `load()`)."""

    def load(self) -> None:
        """Load the model (slow: seconds). Raises EmberError on a bad model or option."""

    def stream_reply(self, messages: list[ChatMessage], settings: ChatSettings,
                     cancel: threading.Event,
                     session: str = "default") -> Iterator[TokenEvent | DoneEvent]:
        """The assistant's reply to `messages`; stops early once `cancel` is set.

        `session` names the conversation, so the engine keeps one KV cache per conversation.
        """

    def stats(self) -> dict:
        """The engine's state after a reply: `{"kv": Engine.kv_usage()'s dict, "lm_head": ...}`.

        Keys the engine does not have are left out; {} before `load()`.
        """


class EngineBackend:
    """The real engine behind the port: loads lazily, so the UI is up before torch is."""

    def __init__(self, model_path: str | Path | None = None, device: str = "auto",
                 n_ctx: int = 4096, threads: int | None = None, engine=None, **options):
        """`options`: further `EngineOptions` fields (kv_budget, kv_host_budget, lm_head)."""
        self.name = Path(model_path).name if model_path else "Gemma 3 270M (default)"
        self._model_path = model_path
        self._options = dict(device=device, n_ctx=n_ctx, threads=threads, **options)
        self._engine = engine

    @classmethod
    def from_engine(cls, engine, name: str = "model") -> "EngineBackend":
        """Wrap an already loaded `Engine` (tests, or a caller that loaded it itself)."""
        backend = cls(engine=engine)
        backend.name = name
        return backend

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx if self._engine is not None else 0

    def load(self) -> None:
        if self._engine is not None:
            return
        from ember.offload.engine import Engine, EngineOptions

        self._engine = Engine.load(self._model_path, EngineOptions(**self._options))

    def stats(self) -> dict:
        if self._engine is None:
            return {}
        return {"kv": self._engine.kv_usage(), "lm_head": self._engine.lm_head}

    def stream_reply(self, messages, settings, cancel, session="default"):
        # Each turn re-encodes the whole conversation; the engine's session for it keeps the
        # KV cache of the shared prefix (swapped to host RAM while another conversation runs),
        # so only the new turn is prefilled.
        prompt_ids = self._engine.encode_chat(messages)
        yield from self._engine.stream(prompt_ids, sampling=settings.sampling(),
                                       max_tokens=settings.max_tokens, cancel=cancel,
                                       session=session)
