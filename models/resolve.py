"""What `--model` (and `--draft-model`, and the chat app's picker) accept, turned into a file.

In order: a path that exists; a catalog name (catalog.py: fetched by `ember pull`, the
default model assembled from its package); a name `ember models` lists (stores.py), in any
case, optionally `STORE:NAME`; an Ollama name without its tag (`:latest`); a Hugging Face
repository with a tag the file names (`ORG/REPO:Q4_K_M`, as llama.cpp takes them).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Mapping

from .catalog import CATALOG, DEFAULT_MODEL, catalog_model, installed_path
from .support.errors import EmberError
from .stores import STORES, Located, locate_models


def resolve_model(text: str, env: Mapping[str, str] | None = None,
                  home: Path | None = None) -> Path:
    """The model file (a split model's first part) or Hugging Face folder `text` names.

    Raises EmberError saying what to do: pull a catalog model, or which names exist.
    """
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith(("/", "./", "../", "~")) or path.suffix in (".gguf", ".safetensors"):
        raise EmberError(f"{text}: no such file or folder")  # a path, not a name
    entry = catalog_model(text)
    if entry is not None:
        if entry.name == DEFAULT_MODEL:
            from .default_model import default_model_path

            return default_model_path()
        found = installed_path(entry)
        if found is None:
            raise EmberError(f"{entry.name} is not downloaded yet: run `ember pull {entry.name}`")
        return found
    located = locate_models(env, home)
    match = _match(text, located)
    if match is None:
        known = [m.name for m in CATALOG] + [m.name for m in located]
        close = difflib.get_close_matches(text, known, n=3, cutoff=0.5)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise EmberError(f"{text}: no such file, and no model of that name{hint}; "
                         "`ember models` lists the models found on this machine")
    if match.problem is not None:
        raise EmberError(f"{text} ({match.path}): {match.problem}")
    return match.path


def _match(text: str, located: list[Located]) -> Located | None:
    store, _, rest = text.partition(":")
    if store in STORES:  # STORE:NAME picks from that store alone
        text, located = rest, [m for m in located if m.store == store]
    key = text.lower()
    by_name: dict[str, Located] = {}
    for m in located:  # the first of the same name is the one without a STORE: prefix
        by_name.setdefault(_bare(m.name).lower(), m)
    for wanted in (key, key + ":latest"):
        if wanted in by_name:
            return by_name[wanted]
    repo, _, tag = key.rpartition(":")
    if repo and tag:  # ORG/REPO:TAG, the file whose name holds TAG
        hits = [m for m in located if m.store != "ollama"
                and (_bare(m.name).lower() + "/").startswith(repo + "/")
                and tag in m.path.name.lower() and not m.path.name.lower().startswith("mmproj")]
        if len(hits) == 1:
            return hits[0]
    return None


def _bare(name: str) -> str:
    """A listed name without the `STORE:` a duplicate name is given."""
    store, _, rest = name.partition(":")
    return rest if store in STORES else name
