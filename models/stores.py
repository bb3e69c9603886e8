"""Where GGUF models already are on this machine: Ember's own model directory and the stores
of the tools people use, read in place (never copied), with the name `--model` takes for each.

- Ember: `$XDG_CACHE_HOME/ember/models/*.gguf`, named by the catalog (catalog.py).
- Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `$XDG_CACHE_HOME/huggingface/hub` (default `~/.cache/huggingface/hub`), with
  `models--ORG--REPO/snapshots/REVISION/**.gguf` (links to its blobs), named `ORG/REPO`, or
  `ORG/REPO/FILE` where the repository holds several models.
- Ollama: `$OLLAMA_MODELS`, else `~/.ollama/models`, with JSON manifests at
  `manifests/HOST/NAMESPACE/MODEL/TAG` whose model layer names a blob `blobs/sha256-HEX`,
  named as Ollama names them (`MODEL:TAG`, `NAMESPACE/MODEL:TAG` off the `library`,
  `HOST/NAMESPACE/MODEL:TAG` off its registry).
- LM Studio: `~/.lmstudio/models` and `~/.cache/lm-studio/models`, with
  `PUBLISHER/REPO/*.gguf`, named `PUBLISHER/REPO` (or `PUBLISHER/REPO/FILE`).

A split model is listed once, by its first part. Only file names and manifests are read
here; what a file holds is models/model_list.py's business.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping

from .catalog import CATALOG
from .gguf_split import model_stem, part_number
from .support.user_dirs import cache_dir

STORES = ("ember", "huggingface", "ollama", "lm-studio")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
_OLLAMA_REGISTRY, _OLLAMA_LIBRARY = "registry.ollama.ai", "library"


@dataclass(frozen=True)
class Located:
    name: str  # what --model takes
    store: str  # one of STORES
    path: Path  # the GGUF file (a split model's first part), as the store keeps it
    problem: str | None = None  # why it cannot be used, found from the layout alone
    note: str | None = None  # something worth knowing (an Ollama projector layer unused)


def store_roots(env: Mapping[str, str] | None = None,
                home: Path | None = None) -> dict[str, list[Path]]:
    """Each store's folders, from the environment as each tool reads it."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    xdg_cache = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    hf_home = Path(env.get("HF_HOME") or xdg_cache / "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or hf_home / "hub"
    return {"ember": [xdg_cache / "ember" / "models"],
            "huggingface": [Path(hub)],
            "ollama": [Path(env.get("OLLAMA_MODELS") or home / ".ollama" / "models")],
            "lm-studio": [home / ".lmstudio" / "models", xdg_cache / "lm-studio" / "models"]}


def locate_models(env: Mapping[str, str] | None = None,
                  home: Path | None = None) -> list[Located]:
    """Every model in every store, in the order of STORES. Names are unique: one a store
    shares with an earlier store's is written `STORE:NAME` (a form every name accepts)."""
    finders = {"ember": _ember, "huggingface": _huggingface, "ollama": _ollama,
               "lm-studio": _lm_studio}
    found, taken = [], set()
    for store, roots in store_roots(env, home).items():
        for root in roots:
            if not root.is_dir():
                continue
            for located in finders[store](root):
                if located.name in taken:
                    located = replace(located, name=f"{store}:{located.name}")
                taken.add(located.name)
                found.append(located)
    return found


def _ember(root: Path) -> Iterator[Located]:
    names = {m.file: m.name for m in CATALOG}
    for path in _gguf_files(root, recursive=False):
        yield Located(names.get(path.name, model_stem(path)), "ember", path)


def _huggingface(hub: Path) -> Iterator[Located]:
    for repo in sorted(hub.glob("models--*--*")):
        snapshot = _current_snapshot(repo)
        if snapshot is None:
            continue
        org, name = repo.name.removeprefix("models--").split("--", 1)
        yield from _named_by_folder(f"{org}/{name}", "huggingface", snapshot, recursive=True)


def _current_snapshot(repo: Path) -> Path | None:
    """The snapshot `refs/main` names, else the newest one."""
    try:
        revision = (repo / "refs" / "main").read_text().strip()
        if (repo / "snapshots" / revision).is_dir():
            return repo / "snapshots" / revision
    except OSError:
        pass
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _lm_studio(root: Path) -> Iterator[Located]:
    for repo in sorted(p for p in root.glob("*/*") if p.is_dir()):
        yield from _named_by_folder(f"{repo.parent.name}/{repo.name}", "lm-studio", repo,
                                    recursive=False)


def _named_by_folder(name: str, store: str, folder: Path, recursive: bool) -> Iterator[Located]:
    """The models in `folder` named `name`, or `name/FILE` when there are several."""
    files = list(_gguf_files(folder, recursive))
    for path in files:
        stem = model_stem(path.relative_to(folder)) if len(files) > 1 else None
        yield Located(f"{name}/{stem}" if stem else name, store, path)


def _gguf_files(folder: Path, recursive: bool) -> Iterator[Path]:
    """GGUF files under `folder`, a split model's later parts and hidden files left out."""
    found = folder.rglob("*.gguf") if recursive else folder.glob("*.gguf")
    for path in sorted(found):
        part = part_number(path)
        if path.name.startswith(".") or (part is not None and part[0] > 1):
            continue
        yield path


def _ollama(root: Path) -> Iterator[Located]:
    manifests = root / "manifests"
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        host, namespace, model, tag = manifest.relative_to(manifests).parts
        name = f"{model}:{tag}"
        if namespace != _OLLAMA_LIBRARY or host != _OLLAMA_REGISTRY:
            name = f"{namespace}/{name}"
        if host != _OLLAMA_REGISTRY:
            name = f"{host}/{name}"
        yield _ollama_model(name, root, manifest)


def _ollama_model(name: str, root: Path, manifest: Path) -> Located:
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
        kinds = {layer.get("mediaType"): layer.get("digest", "") for layer in layers}
    except (OSError, ValueError, AttributeError) as exc:
        return Located(name, "ollama", manifest, problem=f"unreadable manifest ({exc})")
    digest = kinds.get(OLLAMA_MODEL_LAYER)
    if not digest:
        return Located(name, "ollama", manifest, problem="the manifest has no model layer")
    blob = root / "blobs" / digest.replace(":", "-", 1)
    note = ("a vision projector layer (images) is not used: Ember runs text only"
            if OLLAMA_PROJECTOR_LAYER in kinds else None)
    if not blob.is_file():
        return Located(name, "ollama", blob, problem="the model's blob is missing (pulled "
                                                     "only in part?)", note=note)
    return Located(name, "ollama", blob, note=note)
