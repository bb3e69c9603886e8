"""Hugging Face checkpoints: `*.safetensors` shards read through the safetensors library.

The library validates the header (JSON length, dtypes, offsets) and memory-maps the data; no
pickle is ever involved. Tensor names are mapped to Ember's canonical names by the family.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from safetensors import SafetensorError, safe_open

from .support.errors import ModelFormatError
from .weights import QTensor, WeightStore


def shard_paths(folder: Path) -> list[Path]:
    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise ModelFormatError(folder, "no *.safetensors files in this model folder")
    return shards


def load_weights(folder: Path, family: ModuleType) -> WeightStore:
    """All tensors of the folder's shards the family uses, under canonical names."""
    tensors: dict[str, QTensor] = {}
    for shard in shard_paths(folder):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for hf_name in f.keys():
                    name = family.hf_tensor_name(hf_name)
                    if name is None:
                        continue
                    if name in tensors:
                        raise ModelFormatError(shard, f"tensor '{hf_name}' appears in two shards")
                    tensor = family.hf_transform(name, f.get_tensor(hf_name))
                    tensors[name] = _wrap(shard, hf_name, tensor)
        except SafetensorError as exc:
            raise ModelFormatError(shard, f"not a valid safetensors file ({exc})") from None
    return WeightStore(folder, tensors)


def _wrap(path: Path, name: str, tensor) -> QTensor:
    try:
        return QTensor.from_torch(tensor)
    except TypeError:
        raise ModelFormatError(path, f"tensor '{name}' has unsupported dtype {tensor.dtype}") from None
