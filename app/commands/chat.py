"""`ember chat`: the Textual chat app (app/tui). Textual and torch are imported only here."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ember.models.errors import EmberError


def run(args) -> int:
    from ember.app.tui.app import ChatApp
    from ember.app.tui.engine_port import EngineBackend
    from ember.app.tui.store import ChatStore, default_db_path
    from ember.offload.sizes import parse_size

    # Checked here so a typo is one line on the terminal, not a notification in the app.
    if args.model and not Path(args.model).exists():
        raise EmberError(f"{args.model}: no such file or folder")
    if args.ctx_size < 1:
        raise EmberError(f"--ctx-size must be at least 1, got {args.ctx_size}")
    sizes = {key: parse_size(value, "--" + key.replace("_", "-"))
             for key in ("kv_budget", "kv_host_budget")
             if (value := getattr(args, key, None)) is not None}
    db_path = default_db_path()
    try:
        store = ChatStore(db_path)
    except (sqlite3.Error, OSError) as exc:
        raise EmberError(f"{db_path}: cannot open the chat history ({exc})") from None
    # The model loads inside the app, in a worker, so the window appears at once.
    backend = EngineBackend(args.model, device=args.device, n_ctx=args.ctx_size,
                            threads=args.threads, lm_head=args.lm_head, **sizes)
    try:
        ChatApp(backend, store, system_prompt=args.system or "").run()
    finally:
        store.close()
    return 0
