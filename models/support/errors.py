"""Errors raised for bad model files and bad user input.

The CLI turns these into one line on stderr and exit code 2; nothing below `app/` prints.
"""


class EmberError(Exception):
    """Base class for errors the user can act on (bad file, bad flag, impossible budget)."""


class ModelFormatError(EmberError):
    """A model, tokenizer or artifact file is malformed or unsupported.

    The message names the file and the field at fault.
    """

    def __init__(self, path, message: str):
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class UnsupportedModelError(ModelFormatError):
    """The file is well formed but uses an architecture or quant type Ember cannot run."""


class ConfigError(EmberError, ValueError):
    """A setting is out of range (sampling parameters, budgets, sizes); the message says how to
    fix it. `setting`, where one named setting is to blame, names it (the server's `param`)."""

    def __init__(self, message: str = "", setting: str | None = None):
        super().__init__(message)
        self.setting = setting


class PromptTooLong(ConfigError):
    """The prompt leaves no room in the context for a reply (the server answers it with the
    OpenAI code context_length_exceeded)."""
