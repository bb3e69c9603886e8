"""Where tensors live. Every placement goes through here so a GPU tier is one flag away.

`auto` picks CUDA when present and the CPU otherwise; asking for CUDA on a machine without it
is a clear error rather than a silent fallback.
"""

from __future__ import annotations

import torch

from ember.models.support.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA device is available; "
                              "use --device cpu or auto")
        return torch.device(name)
    raise ConfigError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count (None keeps the default); returns the count in use."""
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
