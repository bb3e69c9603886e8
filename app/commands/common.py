"""Helpers shared by the subcommands: building the engine from flags, printing JSON."""

from __future__ import annotations

import json
import sys

from ember.models.errors import EmberError

from ..progress import progress_bar


def model_path(args):
    if args.model:
        return args.model
    from ember.models.default_model import default_model_path

    return default_model_path()


def load_engine(args):
    from ember.offload.runtime.engine import Engine, EngineOptions
    from ember.models.sizes import parse_size

    def size(flag: str):
        value = getattr(args, flag.replace("-", "_"), None)
        return None if value is None else parse_size(value, f"--{flag}")

    options = EngineOptions(device=args.device, n_ctx=args.ctx_size, threads=args.threads,
                            kv_budget=size("kv-budget"), kv_host_budget=size("kv-host-budget"),
                            weights=getattr(args, "weights", "auto"),
                            gpu_budget=size("gpu-budget"), split=getattr(args, "split", "auto"),
                            cold_dtype=getattr(args, "cold_dtype", "auto"),
                            tier_dtype=getattr(args, "tier_dtype", "auto"),
                            tier_attention=getattr(args, "tier_attention", "auto"),
                            profile=_profile(getattr(args, "profile", "auto")),
                            ffn_mode=getattr(args, "ffn_mode", "auto"),
                            speculate=getattr(args, "speculate", "off"),
                            tree=getattr(args, "tree", None),
                            draft_model=getattr(args, "draft_model", None),
                            chat_format=getattr(args, "chat_format", "auto"),
                            mmap=getattr(args, "mmap", "auto"),
                            kv_type=getattr(args, "kv_type", "f16"))
    print("ember: loading model…", file=sys.stderr, flush=True)
    # Erased once loaded: the command's own output follows.
    with progress_bar("loading", getattr(args, "json", False), leave=False) as bar:
        return Engine.load(model_path(args), options, progress=bar)


def _profile(value: str | None) -> str | None:
    return None if value is None or value.lower() == "none" else value


def read_prompt(text: str) -> str:
    prompt = sys.stdin.read() if text == "-" else text
    if not prompt.strip():
        raise EmberError("the prompt is empty; pass some text (or '-' to read standard input)")
    return prompt


def print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)
