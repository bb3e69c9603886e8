"""Per-conversation generation settings: sampling knobs, the reply length and the chat format.

Stored as JSON with each conversation. The defaults and the validation are
`SamplingParams`'s (a plain module: the UI appears before torch has finished importing).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from ember.models.chat_format import CHAT_FORMATS
from ember.models.support.errors import ConfigError
from ember.offload.options.choices import DEFAULT_CHAT_MAX_TOKENS
from ember.offload.options.sampling import SamplingParams

_SAMPLING = SamplingParams()


class SettingError(ConfigError):
    """A settings form value is invalid; `field` names the offending input."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    min_p: float = _SAMPLING.min_p
    repeat_penalty: float = _SAMPLING.repeat_penalty
    max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    seed: int | None = None
    chat_format: str = ""  # a --chat-format choice; "" = the one `ember chat` was started with

    def sampling(self):
        """The engine's `SamplingParams` for these settings (raises ConfigError if out of range)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise SettingError("max_tokens", f"max tokens must be at least 1, got {self.max_tokens}")
        if self.chat_format and self.chat_format not in CHAT_FORMATS:
            raise SettingError("chat_format", f"chat format must be blank or one of "
                               f"{', '.join(CHAT_FORMATS)}; got {self.chat_format!r}")
        try:
            self.sampling()
        except ConfigError as exc:
            raise SettingError(_field_named_in(str(exc)), str(exc)) from None

    # -- storage ------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | None) -> "ChatSettings":
        """Settings from storage; unknown or malformed entries fall back to the defaults.

        Not validated here: the engine validates when it samples, and a bad stored value then
        becomes an error notification rather than a failure to open the conversation.
        """
        try:
            data = json.loads(text or "{}")
        except json.JSONDecodeError:
            return cls()
        if not isinstance(data, dict):
            return cls()
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for name, value in data.items():
            if name == "chat_format":
                if isinstance(value, str) and value in ("", *CHAT_FORMATS):
                    kwargs[name] = value
            elif name in known and (value is None or isinstance(value, (int, float))):
                kwargs[name] = value
        return cls(**kwargs)

    # -- the settings form --------------------------------------------------------------
    def as_form(self) -> dict[str, str]:
        return {f.name: "" if getattr(self, f.name) is None else str(getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_form(cls, form: dict[str, str]) -> "ChatSettings":
        """Parse the settings form's text fields; raises SettingError naming the bad field."""
        kwargs = {}
        for f in fields(cls):
            raw = form.get(f.name, "").strip()
            label = f.name.replace("_", " ")
            if f.name == "chat_format":
                kwargs[f.name] = raw.lower()
                continue
            if f.name == "seed" and raw == "":
                kwargs[f.name] = None  # blank seed: a fresh random draw each reply
                continue
            want_int = f.name in ("top_k", "max_tokens", "seed")
            try:
                kwargs[f.name] = int(raw) if want_int else float(raw)
            except ValueError:
                kind = "a whole number" if want_int else "a number"
                raise SettingError(f.name, f"{label} must be {kind}, got {raw!r}") from None
        settings = cls(**kwargs)
        settings.validate()
        return settings


def _field_named_in(message: str) -> str:
    """Which form field a SamplingParams error message is about (they start with its name)."""
    for name in ("temperature", "top-k", "top-p", "min-p", "repeat penalty"):
        if message.startswith(name):
            return name.replace("-", "_").replace(" ", "_")
    return ""
