"""`kill -9` while a reply streams: on restart every message sent before it is there.

A child Python process runs the chat app headless (`App.run_test`) on a fake engine that
streams slowly, sends two messages and, once the second reply is visibly streaming, says so on
stdout and waits; the parent then SIGKILLs it (no cleanup, no quit handler runs), opens the
same database with `ChatStore` and restarts the app on it.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_asyncio")

from ember.app.tui.store import ChatStore
from tests.test_tui_chat import SIZE, last_view, make_app, send, views, wait_for

ROOT = Path(__file__).resolve().parent.parent
STREAMING = "STREAMING"
LONG_REPLY = " ".join(f"word{i}" for i in range(400))  # 400 x 50 ms: streams for 20 s


async def _child(db: str) -> None:
    from .tui_fakes import FakeEngine

    engine = FakeEngine(["first reply", LONG_REPLY], token_delay=0.05)
    app = make_app(db, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.model_state == "ready")
        await send(pilot, "first message")
        await send(pilot, "second message", wait=False)
        await wait_for(pilot, lambda: app.busy and last_view(app) is not None
                       and last_view(app).content.startswith("word0 word1 word2"))
        print(STREAMING, flush=True)
        await asyncio.sleep(60)  # killed long before this ends


def test_kill_9_mid_reply_loses_nothing_sent_before(tmp_path):
    db = tmp_path / "chat.db"
    code = f"import asyncio, tests.test_tui_kill9 as t; asyncio.run(t._child({str(db)!r}))"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 15)
        line = child.stdout.readline().strip() if ready else ""
        assert line == STREAMING, f"child did not start streaming: {line!r} {child.poll()}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stderr = child.stderr.read()
    assert "Traceback" not in stderr, stderr

    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    store = ChatStore(db)
    try:
        [conversation] = store.list_conversations()
        saved = [(m.role, m.content, m.finish_reason) for m in store.messages(conversation.id)]
    finally:
        store.close()
    # The reply that was streaming is gone with the process; everything before it is kept.
    expected = [("user", "first message", None), ("assistant", "first reply", "eos"),
                ("user", "second message", None)]
    assert saved == expected

    asyncio.run(_restart_shows(db, expected))


async def _restart_shows(db, expected) -> None:
    app = make_app(db)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.model_state == "ready")
        assert views(app) == expected
        assert app.conversation.title == "first message"
    app.store.close()
