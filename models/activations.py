"""The FFN activations: one table for the model, the kernels' references and the C++ kernels.

Each row: the name a `ModelConfig` carries, the integer code the C++ kernels receive (their
`enum class Activation` in kernels/csrc/activation.h lists the same codes in the same order,
and tests/test_activations.py checks both sides agree), whether it is gated, and its math in
PyTorch:

    gated  h = act(gate . x, up . x)    (the FFN has gate rows)
    plain  h = act(up . x)              (no gate rows: OPT-style MLP)

Here, not in kernels/, because models/ is the lowest layer that needs it (the reference
forward runs it) and models/ imports nothing above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    name: str
    code: int  # csrc/activation.h: enum class Activation
    gated: bool
    fn: Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]  # (gate, up) -> h


TABLE: tuple[Activation, ...] = (
    Activation("relu", 0, False, lambda gate, up: F.relu(up)),
    Activation("relu2", 1, False, lambda gate, up: F.relu(up).square()),
    Activation("relu_glu", 2, True, lambda gate, up: F.relu(gate) * up),
    Activation("drelu", 3, True, lambda gate, up: F.relu(gate) * F.relu(up)),
    Activation("silu_glu", 4, True, lambda gate, up: F.silu(gate) * up),
    Activation("gelu_glu", 5, True, lambda gate, up: F.gelu(gate, approximate="tanh") * up),
)
BY_NAME: dict[str, Activation] = {a.name: a for a in TABLE}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def lookup(name: str) -> Activation:
    """The table row of `name`; ValueError naming the choices for an unknown one."""
    row = BY_NAME.get(name)
    if row is None:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(NAMES)}")
    return row


def is_gated(name: str) -> bool:
    """Whether the FFN has gate rows (h = act(gate x, up x)) or only up rows."""
    return lookup(name).gated


def code(name: str) -> int:
    """The integer the C++ kernels take for this activation."""
    return lookup(name).code


def activate(name: str, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    """The FFN's intermediate activation h (T, ffn); gate None for a plain activation."""
    return lookup(name).fn(gate, up)
