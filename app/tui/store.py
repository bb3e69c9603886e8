"""SQLite persistence for chats: conversations, their messages and their settings.

One file, `$XDG_DATA_HOME/ember/chat.db` (default `~/.local/share/ember/chat.db`), in
write-ahead-logging mode. Every write commits at once (autocommit), so a message that was shown
as finished or cancelled survives the app being killed: WAL with synchronous=NORMAL only risks
the last transactions on a power loss, not on a process crash.

All calls happen on the UI thread (SQLite connections are bound to the thread that made them);
each statement is a few milliseconds at most.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .settings import ChatSettings

DEFAULT_TITLE = "New chat"
SCHEMA_VERSION = 2  # 2: conversations.model

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id            INTEGER PRIMARY KEY,
    title         TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings      TEXT NOT NULL DEFAULT '{}',  -- ChatSettings as JSON
    model         TEXT NOT NULL DEFAULT '',    -- the --model name it last ran on; '' none yet
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL,           -- user / assistant
    content         TEXT NOT NULL,
    finish_reason   TEXT,                    -- assistant replies: eos, stop, length, context, cancelled
    created_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages (conversation_id, id);
CREATE TABLE IF NOT EXISTS app_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


_CONVERSATION = "id, title, system_prompt, settings, model"  # the columns of a Conversation


def _conversation(row) -> Conversation:
    return Conversation(row[0], row[1], row[2], ChatSettings.from_json(row[3]), row[4])


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "ember" / "chat.db"


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    settings: ChatSettings
    model: str = ""  # the model it last ran on, as --model names it; "" before any



@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    finish_reason: str | None = None

    @property
    def cancelled(self) -> bool:
        return self.finish_reason == "cancelled"


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(conversations)")}
        if "model" not in columns:  # a version 1 file: conversations remembered no model
            self._db.execute("ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT ''")
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    # -- conversations ------------------------------------------------------------------
    def create_conversation(self, system_prompt: str = "",
                            settings: ChatSettings = ChatSettings(),
                            model: str = "") -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, settings, model, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, ?, ?)",
            (DEFAULT_TITLE, system_prompt, settings.to_json(), model, now, now))
        return Conversation(cur.lastrowid, DEFAULT_TITLE, system_prompt, settings, model)

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute(
            f"SELECT {_CONVERSATION} FROM conversations WHERE id = ?",
            (conversation_id,)).fetchone()
        return None if row is None else _conversation(row)

    def list_conversations(self, search: str = "") -> list[Conversation]:
        """Most recently used first; `search` keeps titles containing it (any case)."""
        pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._db.execute(
            f"SELECT {_CONVERSATION} FROM conversations"
            " WHERE title LIKE ? ESCAPE '\\' ORDER BY updated_at DESC, id DESC", (pattern,))
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def update_settings(self, conversation_id: int, system_prompt: str,
                        settings: ChatSettings) -> None:
        self._db.execute("UPDATE conversations SET system_prompt = ?, settings = ? WHERE id = ?",
                         (system_prompt, settings.to_json(), conversation_id))

    def set_model(self, conversation_id: int, model: str) -> None:
        """Remember that the conversation now runs on `model` (as --model names it)."""
        self._db.execute("UPDATE conversations SET model = ? WHERE id = ?",
                         (model, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                         (time.time(), conversation_id))

    # -- messages -----------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str,
                    finish_reason: str | None = None) -> StoredMessage:
        cur = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, finish_reason, created_at)"
            " VALUES (?, ?, ?, ?, ?)", (conversation_id, role, content, finish_reason, time.time()))
        self._touch(conversation_id)
        return StoredMessage(cur.lastrowid, role, content, finish_reason)

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, role, content, finish_reason FROM messages WHERE conversation_id = ?"
            " ORDER BY id", (conversation_id,))
        return [StoredMessage(*r) for r in rows]

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete the message `message_id` and every later one (regenerate, edit and resend)."""
        self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                         (conversation_id, message_id))

    # -- app state (which conversation was open) ----------------------------------------
    def get_state(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM app_state WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_state(self, key: str, value: str) -> None:
        self._db.execute("INSERT INTO app_state (key, value) VALUES (?, ?)"
                         " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))
