"""Architecture string -> family module, by convention.

A GGUF file names its architecture in `general.architecture`; a Hugging Face folder in
`config.json`'s `model_type`. Each maps to a module `ember.models.<family>` that exports
`config_from_gguf`, `config_from_hf`, `hf_tensor_name` and `hf_transform` (see `gemma3.py`,
`llama.py`), and optionally `unfuse(weights, config)`: the weights under the names every
runtime reads, for files that fuse projections (`phi3.py`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .support.errors import UnsupportedModelError

GGUF_ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3", "llama": "llama", "phi3": "phi3",
                      "qwen2": "qwen", "qwen3": "qwen"}
HF_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "llama": "llama",
                  "mistral": "llama", "phi3": "phi3", "qwen2": "qwen", "qwen3": "qwen"}


def family_for_gguf(arch: str, path) -> ModuleType:
    return _family(GGUF_ARCHITECTURES, arch, path, "architecture")


def family_for_hf(model_type: str, path) -> ModuleType:
    return _family(HF_MODEL_TYPES, model_type, path, "model_type")


def unfused(family: ModuleType, weights, config):
    """`weights` as the runtime reads them: the family's `unfuse` applied, where it has one."""
    unfuse = getattr(family, "unfuse", None)
    return weights if unfuse is None else unfuse(weights, config)


def _family(table: dict[str, str], key: str, path, what: str) -> ModuleType:
    if key not in table:
        raise UnsupportedModelError(
            path, f"{what} '{key}' is not supported (supported: {', '.join(sorted(table))})"
        )
    return importlib.import_module(f".{table[key]}", __package__)
