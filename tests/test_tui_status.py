"""The status bar after a reply: speed, context and the KV cache, fitted to the terminal."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_asyncio")

from ember.app.tui.widgets.sidebar import ConversationList
from ember.app.tui.widgets.status_bar import fit_parts, kv_parts
from tests.test_tui_chat import SIZE, make_app, ready, send, status_text, wait_for
from .tui_fakes import FakeEngine


@pytest.mark.asyncio
async def test_status_shows_kv_blocks_and_swaps_after_each_reply(tmp_path):
    # Room on the device for one conversation's 18 blocks (1 block x 18 layers), not two.
    engine = FakeEngine(["ok"], kv_device_blocks=30, kv_host_blocks=100)
    app = make_app(tmp_path / "chat.db", engine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a")
        assert "KV 18/30 dev · 0 host · 0 swaps" in status_text(app)
        first = app.conversation.id
        await pilot.press("ctrl+n")
        await send(pilot, "b")  # the first conversation moves to host RAM
        assert "KV 18/30 dev · 18 host · 1 swap" in status_text(app)
        sidebar = app.query_one(ConversationList)
        sidebar.focus()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.conversation.id == first)
        await send(pilot, "c")  # swapped back in, the second one out
        status = status_text(app)
        assert "KV 18/30 dev · 18 host · 3 swaps" in status
        assert "tok/s" in status and "ctx " in status


@pytest.mark.asyncio
async def test_status_drops_the_least_important_parts_when_narrow(tmp_path):
    engine = FakeEngine(["ok"], name="gemma-3-270m-it-Q4_K_M.gguf")
    app = make_app(tmp_path / "chat.db", engine)
    async with app.run_test(size=(140, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        wide = status_text(app)
        assert wide.startswith("gemma-3-270m-it-Q4_K_M.gguf · ") and "TTFT" in wide
        assert wide.endswith(" · 0 host · 0 swaps")
        await pilot.resize_terminal(*SIZE)
        await wait_for(pilot, lambda: status_text(app) != wide)
        at_80 = status_text(app)
        assert "gemma" not in at_80 and "KV 18/1803 dev · 0 host · 0 swaps" in at_80
        assert len(at_80) <= SIZE[0] - 2  # no ellipsis: everything shown fits
        await pilot.resize_terminal(40, 24)
        await wait_for(pilot, lambda: status_text(app) != at_80)
        assert status_text(app).endswith(" tok/s · ctx 6/4096")


def test_fit_parts_keeps_order_and_the_most_important():
    parts = [(3, "model"), (1, "fast"), (2, "ctx 1/2")]
    assert fit_parts(parts, 80) == "model · fast · ctx 1/2"
    assert fit_parts(parts, 14) == "fast · ctx 1/2"
    assert fit_parts(parts, 3) == "fast"  # the bar's ellipsis cuts it if it must


def test_kv_parts_from_engine_kv_usage():
    kv = {"device_blocks_used": 312, "device_blocks_free": 1491, "host_blocks_used": 120,
          "host_blocks_free": 1683, "swaps_out": 2, "swaps_in": 1, "dropped": 1}
    assert [text for _, text in kv_parts(kv)] == ["KV 312/1803 dev", "120 host",
                                                  "3 swaps, 1 dropped"]


@pytest.mark.asyncio
async def test_status_names_the_chat_format_when_ready_and_after_a_reply(tmp_path):
    engine = FakeEngine(["ok"], chat_format="transcript")
    app = make_app(tmp_path / "chat.db", engine)
    async with app.run_test(size=(160, 24)) as pilot:
        await ready(pilot)
        assert "ready" in status_text(app) and "transcript chat" in status_text(app)
        await send(pilot, "hello")
        assert status_text(app).endswith(" · transcript chat")
