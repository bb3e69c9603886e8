"""`ember chat`: the Textual chat app (app/tui). Textual and torch are imported only here.

Without --model it starts on the model the open conversation last ran on, else on the
largest instruct model of the catalog that is downloaded, else on the base default model, and
says which and why in a notification (with how to get an instruct model, if none is there).
"""

from __future__ import annotations

import sqlite3

from ember.models.catalog import CATALOG, DEFAULT_MODEL, catalog_model, installed_path
from ember.models.support.errors import EmberError
from ember.models.resolve import resolve_model

from .common import engine_options

PULL_HINT = "ember pull qwen2.5-coder-0.5b-instruct"


def run(args) -> int:
    from ember.app.tui.app import ChatApp
    from ember.app.tui.conversations import initial_conversation
    from ember.app.tui.engine_port import EngineBackend
    from ember.app.tui.store import ChatStore, default_db_path

    # Checked here, before torch, so a typo is one line on the terminal, not a notification
    # in the app; what needs the model is reported as it loads, in a notification.
    if args.model:
        resolve_model(args.model)
    options = engine_options(args)
    db_path = default_db_path()
    try:
        store = ChatStore(db_path)
    except (sqlite3.Error, OSError) as exc:
        raise EmberError(f"{db_path}: cannot open the chat history ({exc})") from None
    try:
        remembered = initial_conversation(store, args.system or "").model
        model, greeting = starting_model(args.model, remembered)
        # The model loads inside the app, in a worker, so the window appears at once.
        ChatApp(EngineBackend(model, options), store, system_prompt=args.system or "",
                greeting=greeting).run()
    finally:
        store.close()
    return 0


def starting_model(flag: str | None, remembered: str = "") -> tuple[str, str]:
    """(the model `ember chat` starts on, as --model names it; what to tell the user).

    `flag`: --model; `remembered`: the model the open conversation last ran on. A remembered
    base default gives way to an instruct model pulled since."""
    if flag:
        return flag, ""
    instruct = [m for m in CATALOG if m.instruct and installed_path(m) is not None]
    best = max(instruct, key=lambda m: m.size, default=None)
    if remembered and not (remembered == DEFAULT_MODEL and best is not None):
        try:
            resolve_model(remembered)
            return remembered, ""
        except EmberError:
            pass  # gone since: start as if the conversation remembered nothing
    if best is not None:
        return best.name, (f"Chatting with {best.title}, an instruct model (F4 picks "
                           "another model).")
    return DEFAULT_MODEL, (f"{catalog_model(DEFAULT_MODEL).title} is a base model: it "
                           "continues text rather than following instructions. For an "
                           f"instruct model, run `{PULL_HINT}` and start ember chat again "
                           "(F4 picks among the models found on this machine).")
