"""Hugging Face model folders: `config.json` with typed, validated access."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .support.errors import ModelFormatError
from .fields import typed

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB; refuse to parse megabytes of it


class HFConfig:
    """The parsed `config.json` of a Hugging Face model folder."""

    _MISSING = object()

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / "config.json"
        if not self.path.is_file():
            raise ModelFormatError(self.folder, "no config.json in this model folder")
        if self.path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelFormatError(self.path, "config.json is larger than 1 MiB")
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(self.path, f"not valid JSON ({exc})") from None
        except RecursionError:  # e.g. 100,000 nested brackets: fits in 1 MiB, overflows json
            raise ModelFormatError(self.path, "JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ModelFormatError(self.path, "config.json must hold a JSON object")
        self.data: dict[str, Any] = data

    @property
    def model_type(self) -> str:
        return self.field("model_type", str)

    def field(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """`key` checked to be of `kind`; a missing or null key gives `default` if one is given."""
        value = self.data.get(key)
        if value is None:
            if default is HFConfig._MISSING:
                raise ModelFormatError(self.path, f"'{key}' is missing")
            return default
        return typed(self.path, f"'{key}'", value, kind)
