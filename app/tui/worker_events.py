"""Messages the engine worker thread posts back to the App (`post_message` is thread-safe).

Each reply message carries the `PendingReply` it belongs to, so the App can tell a stale
message (from a reply it has already given up on) from the current one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from textual.message import Message

from ember.offload.decode.events import DoneEvent


@dataclass(eq=False)
class PendingReply:
    """One assistant reply being generated (or waiting for the model to finish loading)."""

    conversation_id: int
    prompt: str | None  # user text to put back in the input if it fails; None for regenerate
    user_message_id: int | None  # the stored user turn `prompt` became
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class ModelProgress(Message):
    fraction: float  # of loading done, 0..1
    stage: str  # what it is doing, e.g. "layer 3 of 18"


@dataclass
class ModelLoaded(Message):
    stats: dict = field(default_factory=dict)  # EnginePort.stats() once loaded: the placement


@dataclass
class ModelFailed(Message):
    error: str


@dataclass
class ReplyDelta(Message):
    reply: PendingReply
    text: str


@dataclass
class ReplyDone(Message):
    reply: PendingReply
    done: DoneEvent
    stats: dict = field(default_factory=dict)  # EnginePort.stats() right after the reply


@dataclass
class ReplyFailed(Message):
    reply: PendingReply
    error: str
