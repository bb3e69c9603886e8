"""The narrow interface between the chat App and an engine.

The App only ever calls `load()` once and then `stream_reply()` and `stats()`, always from one
worker thread at a time (the Engine is not thread-safe). `load()` reports its progress through a
callback; `stream_reply` yields the engine's own events: a `TokenEvent` per text delta and one
final `DoneEvent` with the finish reason and timings; `stats()`, once loaded and after each
reply, says where the KV cache stands, how the FFN is split and how speculation fares.
The tests' `FakeEngine` (tests/tui_fakes.py) implements the same interface.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator, Protocol

from ember.models.chat_format import ChatMessage
from ember.offload.decode.events import DoneEvent, TokenEvent
from ember.offload.options.engine_options import EngineOptions

from .settings import ChatSettings


class EnginePort(Protocol):
    name: str  # shown in the status bar

    @property
    def n_ctx(self) -> int:
        """Context window in tokens (valid after `load()`)."""

    def load(self, progress: Callable[[float, str], None] | None = None) -> None:
        """Load the model (slow: seconds). Raises EmberError on a bad model or option.

        `progress(fraction, stage)` is called as it goes, ending with (1.0, ...).
        """

    def stream_reply(self, messages: list[ChatMessage], settings: ChatSettings,
                     cancel: threading.Event,
                     session: str = "default") -> Iterator[TokenEvent | DoneEvent]:
        """The assistant's reply to `messages`; stops early once `cancel` is set.

        `session` names the conversation, so the engine keeps one KV cache per conversation.
        """

    def stats(self) -> dict:
        """The engine's state: {} before `load()`, else a dict with

        - "kv": `Engine.kv_usage()` (blocks per tier, swaps), "lm_head": its kind;
        - "hybrid": `Engine.hybrid_report()` (the GPU-tier plan, hot fraction per layer,
          measured FFN sparsity), None for a dense engine;
        - "speculate": the drafter asked for ("off", "self", ...), "speculation": the last
          reply's `SpecStats.to_dict()` (acceptance), None before one or when off;
        - "chat_format": how the latest reply's conversation was written for the model
          ("transcript", ...; before one, the engine's default);
        - "dropped_messages": how many of the conversation's oldest messages the latest
          reply's prompt left out to fit the context (Engine.fit_chat).

        Keys the engine does not have are left out.
        """


class EngineBackend:
    """The real engine behind the port: loads lazily, so the UI is up before torch is."""

    def __init__(self, model_path: str | Path | None = None,
                 options: EngineOptions = EngineOptions()):
        self.name = Path(model_path).name if model_path else "Gemma 3 270M (default)"
        self._model_path = model_path
        self.options = options
        self._engine = None
        self._chat_format: str | None = None  # the format of the latest reply's prompt
        self._dropped = 0  # the latest reply's oldest messages left out to fit the context

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx if self._engine is not None else 0

    def load(self, progress: Callable[[float, str], None] | None = None) -> None:
        from ember.offload.runtime.engine import Engine

        self._engine = Engine.load(self._model_path, self.options, progress=progress)

    def stats(self) -> dict:
        engine = self._engine
        if engine is None:
            return {}
        return {"kv": engine.kv_usage(), "lm_head": engine.lm_head,
                "hybrid": engine.hybrid_report(), "speculate": engine.options.speculate,
                "speculation": engine.speculation,
                "chat_format": self._chat_format or engine.chat_format.name,
                "dropped_messages": self._dropped}

    def stream_reply(self, messages, settings, cancel, session="default"):
        # Each turn re-encodes the whole conversation; the engine's session for it keeps the
        # KV cache of the shared prefix (swapped to host RAM while another conversation runs),
        # so only the new turn is prefilled.
        prompt_ids = self._engine.fit_chat(messages, settings.max_tokens,
                                           settings.chat_format or None)
        self._chat_format = prompt_ids.format.name
        self._dropped = prompt_ids.dropped_messages
        return self._engine.stream(prompt_ids, sampling=settings.sampling(),
                                   max_tokens=settings.max_tokens, cancel=cancel,
                                   session=session)
