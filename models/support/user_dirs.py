"""Where Ember keeps what it derives from models: the user's cache directory, never the model's.

A model folder may be read-only (a shared disk, a package's files) and is the user's
collection either way, so nothing is ever written beside a model. Derived files (the
converted tokenizer, the assembled default model, compiled kernels) live under
`$XDG_CACHE_HOME/ember` (default `~/.cache/ember`), each keyed by what it was derived from.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/ember`, or `~/.cache/ember` when the variable is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember"
