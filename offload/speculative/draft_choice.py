"""What `--speculate auto` drafts with: a same-tokenizer model much smaller than the target
when one is on this machine, else prompt lookup, else nothing.

A draft model pays when it reads a small share of the target's bytes a token and agrees with
it often: a model of the same family (the same tokenizer, piece for piece) at most
`MAX_DRAFT_SHARE` of the target's file size. The 0.5B Qwen2.5-Coder drafting for the 1.5B
is 0.45 of its bytes.
"""

from __future__ import annotations

from pathlib import Path

from ember.models.support.errors import EmberError
from ember.models.gguf_file import GGUFFile
from ember.models.support.user_dirs import cache_dir

MAX_DRAFT_SHARE = 0.5


def draft_model_dirs() -> list[Path]:
    """The folders whose GGUF files may draft: Ember's model folder and the real-model
    folder the project's fetch script fills. (One place, so a model catalog can take over.)"""
    return [cache_dir() / "models", cache_dir() / "real-models"]


def find_draft_model(target: Path, dirs: list[Path] | None = None) -> Path | None:
    """The largest GGUF file in `dirs` that shares `target`'s tokenizer and is at most
    MAX_DRAFT_SHARE of its size (None if there is none, or the target is not a GGUF file)."""
    target = Path(target).resolve()
    tokens = _tokens(target)
    if tokens is None:
        return None
    limit = MAX_DRAFT_SHARE * target.stat().st_size
    fits = [p for p in _gguf_files(dirs if dirs is not None else draft_model_dirs())
            if p != target and p.stat().st_size <= limit]
    for path in sorted(fits, key=lambda p: p.stat().st_size, reverse=True):
        if _tokens(path) == tokens:
            return path
    return None


def _gguf_files(dirs: list[Path]) -> list[Path]:
    return sorted({p.resolve() for d in dirs if d.is_dir() for p in d.glob("*.gguf")
                   if p.is_file()})


def _tokens(path: Path) -> list | None:
    """The file's token pieces (the tokenizer's identity), None for what is not a readable
    GGUF file with a vocabulary."""
    if not path.is_file():
        return None
    try:
        tokens = GGUFFile(path).get("tokenizer.ggml.tokens")
    except (EmberError, OSError, ValueError):
        return None
    return list(tokens) if tokens is not None else None
