"""`ember chat` end to end on a tiny random model: the real engine behind the chat app."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("pytest_asyncio")

from ember.app.tui.app import ChatApp
from ember.app.tui.store import ChatStore
from ember.app.tui.widgets.message_list import MessageView
from ember.app.tui.widgets.prompt_input import PromptInput
from ember.models.testing import synthetic
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from .tui_fakes import PreloadedBackend


@pytest.fixture
def tiny_engine(tmp_path):
    cfg = synthetic.tiny_config("gemma3")
    path = synthetic.write_gguf(tmp_path / "t.gguf", cfg, synthetic.tiny_weights(cfg, 0))
    # Gemma's turns, not the transcript a file without a template gets: the transcript's
    # preamble alone is ~230 tokens of the tiny model's character-level vocabulary.
    return Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, chat_format="gemma"))


async def _until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_chat_with_a_tiny_real_model(tmp_path, tiny_engine):
    app = ChatApp(PreloadedBackend(tiny_engine, "tiny"), ChatStore(tmp_path / "chat.db"))
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(lambda: app.model_state == "ready")
        app.query_one(PromptInput).post_message(PromptInput.Submitted("Hello there"))
        await _until(lambda: app.busy)
        await _until(lambda: not app.busy)
        messages = app.store.messages(app.conversation.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        # A random model says random things: check the shape, not the words.
        assert messages[1].finish_reason in ("eos", "length", "context")
        assert app.query(MessageView).last().content == messages[1].content
        status = str(app.query_one("#status-text").render())
        assert "tok/s" in status and "/128" in status and " dev · " in status  # KV blocks
        await pilot.press("ctrl+q")
    app.store.close()
