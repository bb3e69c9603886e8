"""How `ember chat` looks at 80x24: the main screen, settings, help and the placement view
(pytest-textual-snapshot).

Regenerate after an intended change with `pytest tests/test_tui_snapshots.py --snapshot-update`
and look at the SVGs under tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from ember.app.tui.app import ChatApp
from ember.app.tui.store import ChatStore
from ember.app.tui.widgets.prompt_input import PromptInput
from .tui_fakes import FakeEngine, sample_hybrid_report

SIZE = (80, 24)

REPLY = """Use a list comprehension:

```python
squares = [n * n for n in range(10)]
```

It is **shorter** than a loop."""


def _app(tmp_path, engine: FakeEngine | None = None) -> ChatApp:
    """A store with three conversations, the open one holding a finished and a cancelled reply.

    History comes from the store, not from generating, so nothing time-dependent (tokens/s)
    reaches the screen.
    """
    store = ChatStore(tmp_path / "chat.db")
    for title in ("Trip to Lisbon", "Sourdough starter"):
        store.rename(store.create_conversation().id, title)
    c = store.create_conversation()
    store.rename(c.id, "Python squares")
    store.add_message(c.id, "user", "How do I square the numbers 0 to 9 in Python?")
    store.add_message(c.id, "assistant", REPLY, "eos")
    store.add_message(c.id, "user", "And in Rust?")
    store.add_message(c.id, "assistant", "In Rust you would write an iterator", "cancelled")
    return ChatApp(engine or FakeEngine(), store)


async def _settle(pilot) -> None:
    app = pilot.app
    while app.model_state != "ready":
        await pilot.pause(0.01)
    app.query_one(PromptInput).cursor_blink = False
    await pilot.pause()


def test_main_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=_settle)


def test_settings_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, press=["ctrl+s"], run_before=_settle)


def test_settings_screen_with_an_error(snap_compare, tmp_path):
    async def bad_value(pilot):
        await _settle(pilot)
        await pilot.press("ctrl+s")
        screen = pilot.app.screen
        screen.query_one("#top_p").value = "2"
        await pilot.pause()  # the change event first, then the click (matters on busy CPUs)
        await pilot.click("#save")
        # On a loaded machine the error can land a few frames later (a fresh-clone CI run
        # caught the screen before it): wait for it.
        for _ in range(500):  # at most ~5 s; then the snapshot shows what went wrong
            if str(screen.query_one("#error").render()):
                break
            await pilot.pause(0.01)
        # The clicked button is drawn pressed for 0.2 s: a loaded machine reached the
        # snapshot after that, an idle one before. Snapshot it released.
        save = screen.query_one("#save")
        for _ in range(500):
            if not save.has_class("-active"):
                break
            await pilot.pause(0.01)
        await pilot.pause()

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=bad_value)


def test_help_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, press=["f1"], run_before=_settle)


def test_placement_screen(snap_compare, tmp_path):
    # A scripted report for the default model's shape, measured: 18 layers, so it scrolls.
    app = _app(tmp_path, FakeEngine(hybrid=sample_hybrid_report()))
    assert snap_compare(app, terminal_size=SIZE, press=["f3"], run_before=_settle)


def test_placement_screen_light_and_wide(snap_compare, tmp_path):
    app = _app(tmp_path, FakeEngine(hybrid=sample_hybrid_report(measured=False)))

    async def light(pilot):
        pilot.app.theme = "textual-light"
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(120, 36), press=["f3"], run_before=light)
