"""The chat app's models: the picker (F4) lists what `ember models` finds, switching builds a
new engine for the new model with the same options, each conversation remembers its model,
and `ember chat` starts on an instruct model when one is downloaded, saying so."""

from __future__ import annotations

import sqlite3

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_asyncio")

from textual.widgets import OptionList

from ember.app.commands.chat import starting_model
from ember.app.tui.engine_port import EngineBackend
from ember.app.tui.screens.model_picker import ModelPicker
from ember.app.tui.store import ChatStore
from ember.app.tui.widgets.sidebar import ConversationList
from ember.models.testing import synthetic
from ember.models.catalog import DEFAULT_MODEL, catalog_model, record_verified, target_path
from ember.models.model_list import list_models
from ember.offload.options.engine_options import EngineOptions

from .test_tui_chat import SIZE, make_app, ready, send, wait_for
from .tui_fakes import FakeEngine

QWEN_05 = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def studio_home(tmp_path_factory):
    """A home whose LM Studio folder holds a tiny chat model and a vision projector."""
    home = tmp_path_factory.mktemp("home")
    repo = home / ".lmstudio" / "models" / "someone" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    cfg = synthetic.tiny_config(arch="llama", activation="silu_glu")
    synthetic.write_gguf(repo / "tiny-f32.gguf", cfg, synthetic.tiny_weights(cfg, seed=2))
    (repo / "mmproj-tiny.gguf").write_bytes(b"GGUF" + b"\0" * 40)  # unreadable: listed anyway
    return home


async def _pick(pilot, name: str) -> None:
    app = pilot.app
    await pilot.press("f4")
    assert isinstance(app.screen, ModelPicker)
    picker = app.screen.query_one(OptionList)
    await wait_for(pilot, lambda: picker.option_count > 0)
    index = next(i for i in range(picker.option_count) if picker.get_option_at_index(i).id == name)
    picker.highlighted = index
    await pilot.press("enter")


@pytest.mark.asyncio
async def test_picker_lists_the_stores_and_switches_the_engine(tmp_path, studio_home, empty_cache):
    engine = FakeEngine(["first"], name=DEFAULT_MODEL)
    app = make_app(tmp_path / "chat.db", engine, list_models=lambda: list_models({}, studio_home))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        picker = app.screen.query_one(OptionList)
        await wait_for(pilot, lambda: picker.option_count > 0)
        rows = [picker.get_option_at_index(i) for i in range(picker.option_count)]
        tiny, = [o for o in rows if o.id == "someone/Tiny-GGUF/tiny-f32"]
        assert not tiny.disabled and "llama" in str(tiny.prompt)
        broken = [o for o in rows if "mmproj-tiny" in str(o.prompt)]
        assert len(broken) == 1 and broken[0].disabled and "cannot run" in str(broken[0].prompt)
        assert any(f"ember pull {QWEN_05}" in str(o.prompt) for o in rows)
        await pilot.press("escape")
        await _pick(pilot, "someone/Tiny-GGUF/tiny-f32")
        await ready(pilot)
        assert app.port is not engine and engine.closed
        assert app.port.model == "someone/Tiny-GGUF/tiny-f32"
        assert app.store.conversation(app.conversation.id).model == app.port.model
        await send(pilot, "hello")
        assert app.port.requests and not engine.requests[1:]


@pytest.mark.asyncio
async def test_each_conversation_returns_to_its_model(tmp_path):
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"], name="model-a"),
                   list_models=lambda: [])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "on a")
        first = app.conversation.id
        assert app.store.conversation(first).model == "model-a"
        await pilot.press("ctrl+n")
        assert app.switch_model("model-b")
        await ready(pilot)
        await send(pilot, "on b")
        assert app.store.conversation(app.conversation.id).model == "model-b"
        sidebar = app.query_one(ConversationList)
        sidebar.focus()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.conversation.id == first)
        await ready(pilot)
        assert app.port.model == "model-a"


@pytest.mark.asyncio
async def test_no_switch_while_a_reply_runs(tmp_path):
    engine = FakeEngine(["a long reply " * 50], token_delay=0.02, name="model-a")
    app = make_app(tmp_path / "chat.db", engine, list_models=lambda: [])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go", wait=False)
        assert not app.switch_model("model-b")
        assert app.port is engine and any("before switching" in n for _, n in app.notes)
        await pilot.press("escape")


@pytest.mark.asyncio
async def test_greeting_is_shown(tmp_path):
    app = make_app(tmp_path / "chat.db", FakeEngine(), greeting="Chatting with X.")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert ("information", "Chatting with X.") in app.notes


def test_backend_for_another_model_keeps_the_options():
    options = EngineOptions(device="cpu", n_ctx=256, threads=1)
    first = EngineBackend(None, options)
    assert first.model == DEFAULT_MODEL and first.name.startswith("Gemma 3 270M")
    other = first.for_model("tinychat:latest")
    assert other.options is options and other.model == "tinychat:latest"
    assert other.name == "tinychat:latest"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _installed(name: str) -> None:
    """A catalog model in Ember's directory, recorded as checked (the choice reads only that)."""
    model = catalog_model(name)
    path = target_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    record_verified(path, model.sha256)


def test_chat_starts_on_the_base_model_and_says_how_to_get_an_instruct_one(empty_cache):
    model, greeting = starting_model(None)
    assert model == DEFAULT_MODEL
    assert "base model" in greeting and f"ember pull {QWEN_05}" in greeting


def test_chat_starts_on_the_largest_instruct_model_downloaded(empty_cache):
    _installed(QWEN_05)
    model, greeting = starting_model(None)
    assert model == QWEN_05 and "an instruct model" in greeting
    _installed("qwen2.5-coder-1.5b-instruct")
    assert starting_model(None)[0] == "qwen2.5-coder-1.5b-instruct"
    # A conversation that ran on the base default moves to the instruct model pulled since;
    # one that ran on another instruct model stays on it; --model beats both.
    assert starting_model(None, DEFAULT_MODEL)[0] == "qwen2.5-coder-1.5b-instruct"
    assert starting_model(None, QWEN_05) == (QWEN_05, "")
    assert starting_model("x.gguf", QWEN_05) == ("x.gguf", "")
    assert starting_model(None, "deleted-since:latest")[0] == "qwen2.5-coder-1.5b-instruct"


def test_ember_chat_starts_on_a_pulled_model(empty_cache, monkeypatch, tmp_path):
    from ember.app.cli import main
    from ember.app.tui.app import ChatApp

    _installed(QWEN_05)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    started = []
    monkeypatch.setattr(ChatApp, "run", lambda self: started.append((self.port, self.greeting)))
    assert main(["chat"]) == 0
    (port, greeting), = started
    assert port.model == QWEN_05 and port.name == "Qwen2.5-Coder 0.5B Instruct (Q4_K_M)"
    assert greeting.startswith("Chatting with Qwen2.5-Coder 0.5B Instruct")


def test_a_version_1_history_gains_the_model_column(tmp_path):
    db = tmp_path / "chat.db"
    old = sqlite3.connect(db)
    old.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL, updated_at REAL NOT NULL);
        INSERT INTO conversations VALUES (1, 'old chat', '', '{}', 0, 0);
        PRAGMA user_version=1;
    """)
    old.close()
    store = ChatStore(db)
    assert store.conversation(1).model == ""
    store.set_model(1, QWEN_05)
    assert store.conversation(1).model == QWEN_05
    store.close()
