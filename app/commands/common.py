"""Helpers shared by the subcommands: flags to engine options (the one path every command
takes), building the engine, printing JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ember.models.support.errors import EmberError
from ember.models.resolve import resolve_model
from ember.offload.options.engine_options import EngineOptions  # no torch behind it

from ..progress import progress_bar

# EngineOptions fields a command's flags may set, and the flag (argparse dest) each reads.
_SIZE_FIELDS = ("kv_budget", "kv_host_budget", "gpu_budget")
_PLAIN_FIELDS = {"device": "device", "n_ctx": "ctx_size", "threads": "threads",
                 "weights": "weights", "split": "split", "cold_dtype": "cold_dtype",
                 "tier_dtype": "tier_dtype", "tier_attention": "tier_attention",
                 "gpu": "gpu",
                 "ffn_mode": "ffn_mode", "speculate": "speculate", "tree": "tree",
                 "draft_model": "draft_model", "chat_format": "chat_format", "mmap": "mmap",
                 "kv_type": "kv_type"}


def model_path(args) -> Path:
    """The file --model names (a path, a catalog name, a name `ember models` lists: the one
    resolver every command uses), or the default model. Quick and torch-free: a name that is
    not there is one line now, not an error after torch has loaded."""
    if args.model:
        return resolve_model(args.model)
    from ember.models.default_model import default_model_path

    return default_model_path()


def engine_options(args, **overrides) -> EngineOptions:
    """The `EngineOptions` a command's flags ask for (a flag the command lacks keeps the
    option's default), with `overrides` on top. Checked as far as flags alone allow, before
    torch is imported: `ember chat` shows its window at once, a typo is one line."""
    from ember.models.support.sizes import parse_size

    fields = {name: getattr(args, dest) for name, dest in _PLAIN_FIELDS.items()
              if getattr(args, dest, None) is not None}
    for name in _SIZE_FIELDS:
        if (value := getattr(args, name, None)) is not None:
            fields[name] = parse_size(value, "--" + name.replace("_", "-"))
    profile = getattr(args, "profile", "auto")
    fields["profile"] = None if profile is None or profile.lower() == "none" else profile
    fields |= overrides
    if fields.get("draft_model") is not None:  # a name as --model takes, or a path
        fields["draft_model"] = str(resolve_model(fields["draft_model"]))
    return EngineOptions(**fields)


def load_engine(args, **overrides):
    """The engine for the command's model and flags, with a progress bar while it loads."""
    from ember.offload.runtime.engine import Engine

    options = engine_options(args, **overrides)
    print("ember: loading model…", file=sys.stderr, flush=True)
    # Erased once loaded: the command's own output follows.
    with progress_bar("loading", getattr(args, "json", False), leave=False) as bar:
        return Engine.load(model_path(args), options, progress=bar)


def read_prompt(text: str) -> str:
    prompt = sys.stdin.read() if text == "-" else text
    if not prompt.strip():
        raise EmberError("the prompt is empty; pass some text (or '-' to read standard input)")
    return prompt


def print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)
