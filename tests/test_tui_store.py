"""The chat store (SQLite) and the per-conversation settings, without the UI."""

from __future__ import annotations

import sqlite3

import pytest

from ember.app.tui.settings import ChatSettings, SettingError
from ember.app.tui.store import DEFAULT_TITLE, ChatStore, default_db_path


@pytest.fixture
def store(tmp_path):
    s = ChatStore(tmp_path / "sub" / "chat.db")
    yield s
    s.close()


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "ember" / "chat.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_db_path().parts[-4:] == (".local", "share", "ember", "chat.db")


def test_wal_mode_and_messages_visible_to_another_connection(store):
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c = store.create_conversation("be nice")
    store.add_message(c.id, "user", "hi")
    store.add_message(c.id, "assistant", "hel", "cancelled")
    # Another process (a restarted app) sees them at once: every write is committed.
    other = sqlite3.connect(store.path)
    rows = other.execute("SELECT role, content, finish_reason FROM messages ORDER BY id").fetchall()
    other.close()
    assert rows == [("user", "hi", None), ("assistant", "hel", "cancelled")]
    assert store.messages(c.id)[1].cancelled


def test_conversations_rename_search_order_and_delete(store):
    a = store.create_conversation()
    b = store.create_conversation()
    assert a.title == DEFAULT_TITLE
    store.rename(a.id, "Cats and 100% dogs")
    store.rename(b.id, "Python_help")
    store.add_message(a.id, "user", "x")  # most recently used first
    assert [c.id for c in store.list_conversations()] == [a.id, b.id]
    assert [c.id for c in store.list_conversations("CATS")] == [a.id]
    assert [c.id for c in store.list_conversations("100%")] == [a.id]
    assert [c.id for c in store.list_conversations("n_h")] == [b.id]
    assert [c.id for c in store.list_conversations("%")] == [a.id]  # literal, not a wildcard
    store.delete_conversation(a.id)
    assert store.conversation(a.id) is None
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_delete_messages_from(store):
    c = store.create_conversation()
    ids = [store.add_message(c.id, r, t).id for r, t in
           [("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4")]]
    store.delete_messages_from(c.id, ids[2])
    assert [m.content for m in store.messages(c.id)] == ["1", "2"]


def test_settings_stored_per_conversation(store):
    a = store.create_conversation()
    b = store.create_conversation()
    store.update_settings(a.id, "terse", ChatSettings(temperature=0.2, seed=3))
    assert store.conversation(a.id).settings == ChatSettings(temperature=0.2, seed=3)
    assert store.conversation(a.id).system_prompt == "terse"
    assert store.conversation(b.id).settings == ChatSettings()


def test_app_state(store):
    assert store.get_state("k") is None
    store.set_state("k", "1")
    store.set_state("k", "2")
    assert store.get_state("k") == "2"


def test_settings_json_round_trip_and_tolerance():
    s = ChatSettings(temperature=0.0, top_k=5, seed=42, max_tokens=64)
    assert ChatSettings.from_json(s.to_json()) == s
    assert ChatSettings.from_json("not json") == ChatSettings()
    assert ChatSettings.from_json('{"temperature": "hot", "unknown": 1, "top_k": 7}') == \
        ChatSettings(top_k=7)


def test_settings_form_parsing():
    form = ChatSettings().as_form()
    assert form["seed"] == "" and form["temperature"] == "0.8"
    assert ChatSettings.from_form(form) == ChatSettings()
    assert ChatSettings.from_form({**form, "seed": " 9 ", "top_p": "1"}) == \
        ChatSettings(seed=9, top_p=1.0)
    assert form["chat_format"] == ""  # blank: the format `ember chat` was started with
    assert ChatSettings.from_form({**form, "chat_format": " Gemma "}).chat_format == "gemma"


def test_settings_chat_format_is_stored_and_a_bad_stored_one_ignored():
    s = ChatSettings(chat_format="transcript")
    assert ChatSettings.from_json(s.to_json()) == s
    assert ChatSettings.from_json('{"chat_format": "alpaca", "top_k": 3}') == ChatSettings(top_k=3)
    assert ChatSettings.from_json('{"chat_format": 7}') == ChatSettings()


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "-0.5", "temperature must be >= 0"),
    ("temperature", "warm", "temperature must be a number"),
    ("top_p", "0", "top-p must be in (0, 1]"),
    ("top_k", "2.5", "top k must be a whole number"),
    ("min_p", "1", "min-p must be in [0, 1)"),
    ("repeat_penalty", "0", "repeat penalty must be > 0"),
    ("max_tokens", "0", "max tokens must be at least 1"),
    ("seed", "x", "seed must be a whole number"),
    ("chat_format", "alpaca", "chat format must be blank or one of auto, template, transcript"),
])
def test_settings_form_errors_name_the_field(field, value, message):
    form = {**ChatSettings().as_form(), field: value}
    with pytest.raises(SettingError) as info:
        ChatSettings.from_form(form)
    assert info.value.field == field
    assert message in str(info.value)
