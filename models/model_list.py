"""What `ember models` shows for each model the stores hold (stores.py): architecture,
parameters, size, quant and chat format, read from the GGUF header alone (no torch, no
weights), and for a file Ember cannot run, why. Nothing found is hidden and nothing found
makes the listing fail: a file that does not parse is listed with the parser's complaint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from gguf import LlamaFileType

from .chat_format import template_style
from .support.errors import EmberError
from .gguf_file import GGUFFile
from .registry import GGUF_ARCHITECTURES
from .stores import Located, locate_models

# Tensors and metadata of a vision tower that a text model's file may carry beside it
# (Ollama's multimodal Gemma 3 files, for instance): the text model still runs without it.
_VISION_TENSOR_PREFIXES = ("v.", "mm.")


@dataclass(frozen=True)
class ModelListing:
    name: str  # what --model takes
    store: str
    path: str
    size_bytes: int  # all parts of a split model
    architecture: str | None = None
    parameters: int | None = None
    quant: str | None = None  # the file type it was made as, e.g. Q4_K_M
    chat_format: str | None = None  # "template (chatml)", "transcript (base model)"
    problem: str | None = None  # why Ember cannot run it; None: it can
    note: str | None = None

    @property
    def runnable(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict:
        return asdict(self) | {"runnable": self.runnable}


def list_models(env: Mapping[str, str] | None = None,
                home: Path | None = None) -> list[ModelListing]:
    """Every model in every store (stores.locate_models), described."""
    return [describe(located) for located in locate_models(env, home)]


def describe(located: Located) -> ModelListing:
    base = dict(name=located.name, store=located.store, path=str(located.path),
                note=located.note)
    if located.problem is not None:
        return ModelListing(size_bytes=_size(located.path), problem=located.problem, **base)
    try:
        f = GGUFFile(located.path)
    except EmberError as exc:
        return ModelListing(size_bytes=_size(located.path), problem=_without_path(exc), **base)
    except (OSError, ValueError) as exc:  # unreadable (permissions), or not mappable
        return ModelListing(size_bytes=_size(located.path), problem=f"cannot read it ({exc})",
                            **base)
    arch = f.get("general.architecture")
    template = f.get("tokenizer.chat_template")
    style = template_style(template) if isinstance(template, str) else None
    vision = any(n.startswith(_VISION_TENSOR_PREFIXES) for n in f.tensors)
    if vision and base["note"] is None:
        base["note"] = "its vision tower is not used: Ember runs text only"
    return ModelListing(
        size_bytes=f.nbytes, architecture=arch if isinstance(arch, str) else None,
        parameters=sum(math.prod(t.shape) for n, t in f.tensors.items()
                       if not n.startswith(_VISION_TENSOR_PREFIXES)),
        quant=_quant(f), problem=_problem(f, arch),
        chat_format=(f"template ({style})" if style else "template") if isinstance(
            template, str) else "transcript (base model)", **base)


def _problem(f: GGUFFile, arch) -> str | None:
    if arch == "clip" or f.path.name.lower().startswith("mmproj"):
        return ("a vision projector (mmproj) for a model's image input, not a language model: "
                "Ember runs text only")
    if arch not in GGUF_ARCHITECTURES:
        return (f"architecture '{arch}' is not supported (Ember runs "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
    return None


def _quant(f: GGUFFile) -> str | None:
    """The file type the file says it was made as, else its most common tensor type by bytes."""
    file_type = f.get("general.file_type")
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, TypeError):
        pass
    by_type: dict[str, int] = {}
    for t in f.tensors.values():
        by_type[t.qtype_name] = by_type.get(t.qtype_name, 0) + t.nbytes
    return max(by_type, key=by_type.get, default=None)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _without_path(exc: EmberError) -> str:
    path = getattr(exc, "path", None)
    text = str(exc)
    return text.removeprefix(f"{path}: ") if path else text
