"""`ember chat`: the Textual chat app (app/tui). Textual and torch are imported only here."""

from __future__ import annotations

import sqlite3

from ember.models.errors import EmberError

from .common import check_model_path, engine_options


def run(args) -> int:
    from ember.app.tui.app import ChatApp
    from ember.app.tui.engine_port import EngineBackend
    from ember.app.tui.store import ChatStore, default_db_path

    # Checked here, before torch, so a typo is one line on the terminal, not a notification
    # in the app; what needs the model is reported as it loads, in a notification.
    check_model_path(args)
    options = engine_options(args)
    db_path = default_db_path()
    try:
        store = ChatStore(db_path)
    except (sqlite3.Error, OSError) as exc:
        raise EmberError(f"{db_path}: cannot open the chat history ({exc})") from None
    # The model loads inside the app, in a worker, so the window appears at once.
    backend = EngineBackend(args.model, options)
    try:
        ChatApp(backend, store, system_prompt=args.system or "").run()
    finally:
        store.close()
    return 0
