"""`ember chat`: the Textual chat app (app/tui). Textual and torch are imported only here."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ember.models.errors import EmberError


def run(args) -> int:
    from ember.app.tui.app import ChatApp
    from ember.app.tui.engine_port import EngineBackend
    from ember.app.tui.store import ChatStore, default_db_path

    # Checked here so a typo is one line on the terminal, not a notification in the app.
    options = engine_options(args)
    db_path = default_db_path()
    try:
        store = ChatStore(db_path)
    except (sqlite3.Error, OSError) as exc:
        raise EmberError(f"{db_path}: cannot open the chat history ({exc})") from None
    # The model loads inside the app, in a worker, so the window appears at once.
    backend = EngineBackend(args.model, **options)
    try:
        ChatApp(backend, store, system_prompt=args.system or "").run()
    finally:
        store.close()
    return 0


def engine_options(args) -> dict:
    """`EngineOptions` fields from the flags, checked as far as flags alone allow.

    Without importing torch (the window should appear at once): what needs the model, such
    as a budget below its minimum or a profile made for another model, is reported by the
    engine as it loads, in a notification.
    """
    from ember.models.sizes import parse_size

    if args.model and not Path(args.model).exists():
        raise EmberError(f"{args.model}: no such file or folder")
    if args.ctx_size < 1:
        raise EmberError(f"--ctx-size must be at least 1, got {args.ctx_size}")
    options = dict(device=args.device, n_ctx=args.ctx_size, threads=args.threads,
                   chat_format=getattr(args, "chat_format", "auto"))
    if (weights := getattr(args, "weights", None)) is not None:
        options["weights"] = weights
    for key in ("kv_budget", "kv_host_budget", "gpu_budget"):
        if (value := getattr(args, key, None)) is not None:
            options[key] = parse_size(value, "--" + key.replace("_", "-"))
    options.update(_split_options(args, options.get("gpu_budget")))
    options.update(_speculation_options(args))
    return options


def _split_options(args, gpu_budget: int | None) -> dict:
    split = getattr(args, "split", "auto")
    if split != "auto" and gpu_budget is None:
        raise EmberError(f"--split {split} needs --gpu-budget (the GPU tier's size)")
    profile = getattr(args, "profile", "auto")
    if profile is not None and profile.lower() == "none":
        profile = None
    if profile not in (None, "auto") and not Path(profile).is_file():
        raise EmberError(f"--profile {profile}: no such file")
    ffn_mode = getattr(args, "ffn_mode", "auto")
    if ffn_mode == "sparse" and profile is None:
        raise EmberError("--ffn-mode sparse needs --profile (the predictors come from "
                         "`ember profile`)")
    return dict(split=split, profile=profile, ffn_mode=ffn_mode,
                cold_dtype=getattr(args, "cold_dtype", "auto"),
                tier_dtype=getattr(args, "tier_dtype", "auto"),
                tier_attention=getattr(args, "tier_attention", "auto"))


def _speculation_options(args) -> dict:
    speculate = getattr(args, "speculate", None)
    if speculate is None:  # this build's CLI has no speculation flags
        return {}
    tree, draft = getattr(args, "tree", None), getattr(args, "draft_model", None)
    if (speculate == "model") != (draft is not None):
        raise EmberError("--speculate model needs --draft-model PATH, and --draft-model "
                         "needs --speculate model")
    if draft is not None and not Path(draft).exists():
        raise EmberError(f"--draft-model {draft}: no such file or folder")
    if tree is not None:
        # Only with --tree: its parser comes with torch, which loading needs anyway.
        from ember.offload.speculative.token_tree import parse_tree

        parse_tree(tree)
    return dict(speculate=speculate, tree=tree, draft_model=draft)
