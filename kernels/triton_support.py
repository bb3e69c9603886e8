"""Triton for the GPU tier's kernels (kernels/tier_blocks_triton.py, kernels/tier_layer_triton.py):
whether they can run on a device, and each kernel compiled once per mode.

Triton comes with CUDA builds of PyTorch, not with CPU ones, so it is imported on first use,
never at import time. `EMBER_TIER_TRITON=0` turns the kernels off (the tier then runs plain
torch ops); `EMBER_TIER_TRITON=cpu` runs them on CPU tensors too, in Triton's interpreter
(the tests' CPU path). The interpreter needs TRITON_INTERPRET=1 before anything imports
Triton (it takes its mode then, and PyTorch's optimizers import it), so tests/conftest.py
sets it for the whole session on a machine without CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

ENV = "EMBER_TIER_TRITON"
_triton = None
_checked: dict = {}
log = logging.getLogger("ember.kernels")


def interpreted() -> bool:
    return bool(os.environ.get("TRITON_INTERPRET"))


def available() -> bool:
    """Whether Triton is installed here (without importing it: see the module docstring)."""
    return importlib.util.find_spec("triton") is not None


def usable(device: torch.device | str) -> bool:
    """Whether the tier's Triton kernels run for tensors on `device`: Triton present, and a
    CUDA device (or, asked for, the interpreter's CPU stand-in), and not turned off."""
    choice = os.environ.get(ENV, "1")
    if choice == "0":
        return False
    if torch.device(device).type != "cuda" and not (choice == "cpu" and interpreted()):
        return False
    return imported() is not None


def checked(name: str, device: torch.device | str, check) -> bool:
    """Whether kernels `name` pass `check(device)` (their results against their plain
    references on small inputs), run once per process and device. Kernels this Triton or this
    GPU cannot compile, or that compute something else, are then left for the torch ops, with
    one warning saying why, instead of failing a decode."""
    key = (name, str(torch.device(device)))
    if key not in _checked:
        try:
            ok, why = bool(check(torch.device(device))), "results differ from the references"
        except Exception as exc:  # a compiler's or a driver's error, whatever its type
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            ok, why = False, f"{type(exc).__name__}: {first}"
        if not ok:
            log.warning("the GPU tier's %s kernels are off on %s (%s); plain torch ops run "
                        "instead (%s=0 silences this)", name, key[1], why, ENV)
        _checked[key] = ok
    return _checked[key]


def imported():
    """The triton module, or None where it does not import."""
    global _triton
    if _triton is None:
        try:
            import triton
            import triton.language  # noqa: F401  (the kernels' `tl`)
        except ImportError:
            return None
        _triton = triton
    return _triton


def _bf16_bits_source(x):
    # float32 -> the int16 bits of its bfloat16, rounded to nearest even as torch rounds
    # (Triton's interpreter truncates instead; by hand, every backend gives torch's bits)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


HELPERS = {"bf16_bits": _bf16_bits_source}  # functions a kernel may call, by name
tl = None  # triton.language, bound for the helpers with the kernels'


class Kernel:
    """A kernel's source function, compiled on its first launch (`kernel[grid](...)`): jit
    for the GPU, or interpreted on the CPU. The source reads `tl`, and the `helpers` it
    calls (names in HELPERS), from its module: bound here, compiled the same way."""

    def __init__(self, source, helpers: tuple[str, ...] = ()):
        self.source, self.helpers = source, helpers
        self._made = {}

    def __getitem__(self, grid):
        triton = imported()
        if triton is None:
            raise RuntimeError("the GPU tier's kernels need Triton (it comes with CUDA builds "
                               f"of PyTorch); set {ENV}=0 to run plain torch ops")
        mode = interpreted()
        if mode not in self._made:
            for module in (self.source.__globals__, globals()):
                module["tl"] = triton.language
            for name in self.helpers:  # plain Python in the interpreter, jit for the GPU
                self.source.__globals__[name] = HELPERS[name] if mode else \
                    triton.jit(HELPERS[name])
            if mode:
                from triton.runtime.interpreter import InterpretedFunction
                self._made[mode] = InterpretedFunction(self.source)
            else:
                self._made[mode] = triton.jit(self.source)
        return self._made[mode][grid]
