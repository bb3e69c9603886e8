"""The profile artifact `ember profile` writes and `--profile` loads: one safetensors file.

    tensors   layer.{i}.frequency  (ffn,) float32   how often each neuron fired in calibration
              layer.{i}.hot        (n,) int64        the placement's hot neurons (may be empty)
              predictor tensors    from `PredictorSet.to_tensors()`
    metadata  "ember_profile": JSON  format version, the model's fingerprint and shape, the
              solver's budget, per-layer thresholds and predictor reports, quality figures

The file comes from disk, so it is validated like a model file: the safetensors header is
parsed by the `safetensors` library (no pickle), then every tensor's dtype and shape is
checked against the model it is loaded with, indices against the FFN size, numbers against
their ranges. A profile made for another model is refused by fingerprint. Written
atomically, so an interrupted `ember profile` leaves the previous file or none.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember.models.support.atomic import atomic_write_bytes
from ember.models.config import ModelConfig
from ember.models.support.errors import ConfigError, ModelFormatError
from ember.placement.layout import Placement

FORMAT = "ember-profile"
VERSION = 1
META_KEY = "ember_profile"


# A profile's safetensors header (its JSON metadata and tensor table) is far below this.
MAX_HEADER_BYTES = 64 << 20


def default_profile_path(fingerprint: str) -> Path:
    """Where `ember profile` writes by default and `--profile auto` looks."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "ember" / "profiles" / f"{fingerprint[:16]}.safetensors"


@dataclass
class Profile:
    fingerprint: str
    model_name: str
    n_layers: int
    hidden: int
    ffn: int
    frequency: list[torch.Tensor]  # per layer (ffn,) in [0, 1]
    placement: Placement
    predictor_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # thresholds, reports, quality figures, budget
    bias: list[torch.Tensor | None] = field(default_factory=list)  # per layer (hidden,) or None

    def neuron_order(self) -> list:
        """Per layer, neuron indices hottest first (for cutting a placement to a budget)."""
        return [torch.argsort(f, descending=True, stable=True).numpy() for f in self.frequency]

    # -- writing ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save

        tensors = dict(self.predictor_tensors)
        for i in range(self.n_layers):
            tensors[f"layer.{i}.frequency"] = self.frequency[i].float().contiguous()
            tensors[f"layer.{i}.hot"] = torch.from_numpy(self.placement.hot[i]).to(torch.int64)
            if i < len(self.bias) and self.bias[i] is not None:
                tensors[f"layer.{i}.bias"] = self.bias[i].float().contiguous()
        header = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                  "model_name": self.model_name, "n_layers": self.n_layers,
                  "hidden": self.hidden, "ffn": self.ffn, **self.meta}
        data = save(tensors, metadata={META_KEY: json.dumps(header)})
        atomic_write_bytes(path, data)
        return Path(path)


def thresholds_inputs(path: str | Path) -> bool | None:
    """Whether the profile at `path` thresholds matmul inputs (GLU models, no predictors)
    rather than gating neurons by predictors, read from its header alone; None when the file
    cannot say (missing or malformed: `load_profile` then names the fault)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= MAX_HEADER_BYTES:
                return None
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        return "input_thresholds" in json.loads(meta.get(META_KEY, ""))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None


def load_profile(path: str | Path, cfg: ModelConfig, fingerprint: str) -> Profile:
    """Read and validate a profile for the model with this config and fingerprint."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no profile at {path}; run `ember profile` for this model first")
    tensors, header = _read(path)

    def bad(msg: str) -> ModelFormatError:
        return ModelFormatError(path, msg)

    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise bad(f"not an Ember profile of version {VERSION} "
                  f"(format {header.get('format')!r}, version {header.get('version')!r})")
    if header.get("fingerprint") != fingerprint:
        raise ConfigError(f"{path} was made for another model ({header.get('model_name')!r}, "
                          f"fingerprint {str(header.get('fingerprint'))[:12]}…); run "
                          f"`ember profile` for this one")
    shape = (header.get("n_layers"), header.get("hidden"), header.get("ffn"))
    if shape != (cfg.n_layers, cfg.hidden_size, cfg.ffn_size):
        raise bad(f"layers/hidden/ffn {shape} do not match the model's "
                  f"{(cfg.n_layers, cfg.hidden_size, cfg.ffn_size)}")
    frequency, hot, bias = [], [], []
    for i in range(cfg.n_layers):
        f = _tensor(tensors, f"layer.{i}.frequency", torch.float32, bad)
        if f.shape != (cfg.ffn_size,) or not bool(((f >= 0) & (f <= 1)).all()):
            raise bad(f"layer.{i}.frequency must be {cfg.ffn_size} values in [0, 1]")
        h = _tensor(tensors, f"layer.{i}.hot", torch.int64, bad)
        if h.dim() != 1 or h.numel() > cfg.ffn_size:
            raise bad(f"layer.{i}.hot must be 1-D with at most {cfg.ffn_size} indices")
        frequency.append(f)
        hot.append(h.numpy())
        b = tensors.get(f"layer.{i}.bias")
        if b is not None and (b.dtype != torch.float32 or b.shape != (cfg.hidden_size,)
                              or not bool(torch.isfinite(b).all())):
            raise bad(f"layer.{i}.bias must be {cfg.hidden_size} finite float32 values")
        bias.append(b)
    try:
        placement = Placement((cfg.ffn_size,) * cfg.n_layers, tuple(hot))
    except ValueError as exc:
        raise bad(str(exc)) from None
    predictors = {k: v for k, v in tensors.items() if not k.startswith("layer.")}
    meta = {k: v for k, v in header.items()
            if k not in ("format", "version", "fingerprint", "model_name", "n_layers", "hidden", "ffn")}
    _check_numbers(meta.get("activation_thresholds"), cfg.n_layers, bad)
    if "input_thresholds" in meta:
        from ..body.input_sparsity import check_thresholds

        from ..body.input_sparsity import LAYOUTS, SLOTS

        try:
            meta["input_thresholds"] = check_thresholds(meta["input_thresholds"], cfg.n_layers)
        except ConfigError as exc:
            raise bad(str(exc)) from None
        if meta.get("input_layout", "tiles") not in LAYOUTS:
            raise bad(f"input_layout must be one of {', '.join(LAYOUTS)}")
        pays = meta.get("input_pays", [])
        if not isinstance(pays, list) or not set(pays) <= set(SLOTS):
            raise bad(f"input_pays must list slots among {', '.join(SLOTS)}")
    return Profile(fingerprint, str(header.get("model_name")), cfg.n_layers, cfg.hidden_size,
                   cfg.ffn_size, frequency, placement, predictors, meta, bias)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
        tensors = load(data)
        meta = _header_metadata(data)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFormatError(path, f"unreadable profile ({exc}); run `ember profile` again") from None
    try:
        header = json.loads(meta.get(META_KEY, ""))
    except (ValueError, TypeError, RecursionError):
        raise ModelFormatError(path, f"the {META_KEY!r} metadata is missing or not JSON") from None
    if not isinstance(header, dict):
        raise ModelFormatError(path, f"the {META_KEY!r} metadata is not a JSON object")
    return tensors, header


def _header_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors header (already validated by `load`)."""
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8: 8 + n]).get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def _tensor(tensors, name, dtype, bad) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise bad(f"tensor {name} is missing")
    if t.dtype != dtype:
        raise bad(f"tensor {name} is {t.dtype}, expected {dtype}")
    return t


def _check_numbers(values, n_layers: int, bad) -> None:
    if values is None:
        return
    if (not isinstance(values, list) or len(values) != n_layers
            or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values)):
        raise bad(f"activation_thresholds must be {n_layers} finite non-negative numbers")
