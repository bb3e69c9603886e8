"""Which type each hot FFN matrix takes on the GPU tier (kernels/tier_weights.py formats).

Per tensor, from the file's own type and the device's capability (`--tier-dtype auto`):

    Q4-family and lower (Q4_0/1, Q4_K, IQ4, Q2_K, Q3_K, IQ1-3)   int4 (32-value groups)
    Q5_*, Q6_K, Q8_*                                              int8 (per-row scales)
    F16 / BF16 / F32                                             fp16 / bf16 / fp16

int4 needs PyTorch's int4 matmul on the device (CUDA sm80+, or the CPU op); without it int4
rows become int8. bf16 needs sm80+ on CUDA (else fp16). Float32 only when asked (`fp32`), or
when the rows come from the float32 reference model (`--weights fp32/q8`), whose file types
are gone. A fused matmul (gate with up) takes the wider of its tensors' formats.

Attention (q/k/v/o and the norms) and its KV pool go to the tier in the device's 16-bit type
(`--tier-attention auto`: bf16 on sm80+, fp16 before; fp32 only when asked) when the tier is
a GPU and the budget holds them; "host" keeps them on the file's blocks in host RAM, which is
also what "auto" does when the tier is the CPU (the tests' stand-in: same memory, and the C++
step on the blocks is the faster way through it). A named type moves them on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels.tier_weights import (INT4_GROUP, conversion_error, has_kernel, int4_fits,
                                        wider)
from ember.models.errors import ConfigError

from ..options.choices import ATTENTION_CHOICES, TIER_CHOICES

_ATTENTION_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_INT4_TYPES = ("Q4", "IQ4", "Q2", "Q3", "IQ1", "IQ2", "IQ3", "TQ")
_INT8_TYPES = ("Q5", "Q6", "Q8")


@dataclass(frozen=True)
class TierCaps:
    """What the tier's device does well: int4 tiles, and its 16-bit type."""

    int4: bool
    half: torch.dtype

    @classmethod
    def of(cls, device: torch.device) -> "TierCaps":
        if device.type == "cuda":
            major, _ = torch.cuda.get_device_capability(device)
            modern = major >= 8  # tinygemm's int4 tiles and fast bf16: Ampere and later
            return cls(modern and has_kernel("_weight_int4pack_mm", device),
                       torch.bfloat16 if modern else torch.float16)
        return cls(has_kernel("_weight_int4pack_mm_for_cpu", device), torch.bfloat16)


def format_for_type(type_name: str | None, caps: TierCaps) -> str:
    """The auto format for one tensor of file type `type_name` (None: float reference rows)."""
    if type_name is None:
        return "fp32"
    if type_name.startswith(_INT4_TYPES):
        return "int4" if caps.int4 else "int8"
    if type_name.startswith(_INT8_TYPES):
        return "int8"
    if type_name == "BF16":
        return "bf16" if caps.half == torch.bfloat16 else "fp16"
    return "fp16"


@dataclass(frozen=True)
class TierChoice:
    """`--tier-dtype` resolved against a device: formats per layer from tensor types."""

    choice: str
    caps: TierCaps

    @classmethod
    def resolve(cls, choice: str, device: torch.device) -> "TierChoice":
        if choice not in TIER_CHOICES:
            raise ConfigError(f"unknown --tier-dtype {choice!r}; choose one of "
                              f"{', '.join(TIER_CHOICES)}")
        caps = TierCaps.of(device)
        if choice == "int4" and not caps.int4:
            raise ConfigError(f"--tier-dtype int4 needs PyTorch's int4 matmul on {device} "
                              "(CUDA compute capability 8.0 or later); use int8 or auto")
        if choice == "bf16" and caps.half != torch.bfloat16:
            raise ConfigError(f"--tier-dtype bf16 is slow or missing on {device}; use fp16")
        return cls(choice, caps)

    @property
    def half(self) -> torch.dtype:
        return self.caps.half

    def formats(self, gate_up_types: list[str | None], down_type: str | None) -> tuple[str, str]:
        """(gate_up's format, down's format) for one layer from its tensors' file types."""
        if self.choice != "auto":
            return self.choice, self.choice
        gu = [format_for_type(t, self.caps) for t in gate_up_types]
        fused = gu[0] if len(gu) == 1 else wider(gu[0], gu[1])
        return fused, format_for_type(down_type, self.caps)


def attention_dtype(choice: str, device: torch.device,
                    gpu: bool | None = None) -> torch.dtype | None:
    """`--tier-attention` resolved against the tier's device: the type attention and its KV
    pool take there, or None when they stay on the host. `gpu`: plan as for a GPU tier
    (None: when `device` is CUDA); `ember info` plans the GPU the budget describes."""
    if choice not in ATTENTION_CHOICES:
        raise ConfigError(f"unknown --tier-attention {choice!r}; choose one of "
                          f"{', '.join(ATTENTION_CHOICES)}")
    if choice == "host":
        return None
    caps = TierCaps.of(device)
    if choice == "auto":
        return caps.half if (device.type == "cuda" if gpu is None else gpu) else None
    if choice == "bf16" and caps.half != torch.bfloat16:
        raise ConfigError(f"--tier-attention bf16 is slow or missing on {device}; use fp16")
    return _ATTENTION_TYPES[choice]


def dtype_name(dtype: torch.dtype) -> str:
    """bf16, fp16 or fp32: the flags' names for a torch type."""
    return {v: k for k, v in _ATTENTION_TYPES.items()}[dtype]


def sampled_errors(weights, n_layers: int, gated: bool, formats: list[tuple[str, str]],
                   half: torch.dtype, rows: int = 64) -> dict[str, float]:
    """Conversion error of the tier formats against the file's rows, from `rows` rows of
    the first, middle and last layers (max over them): gate/up rows are neurons; down's
    file rows (one per hidden unit, across all neurons) are what the tier's down matrix
    quantizes along, so they sample it as well. For `ember info`, which loads no model."""
    out = {"gate_up": 0.0, "down": 0.0}
    for i in sorted({0, n_layers // 2, n_layers - 1}):
        p = f"blk.{i}."
        names = {"gate_up": ([p + "ffn_gate.weight"] if gated else []) + [p + "ffn_up.weight"],
                 "down": [p + "ffn_down.weight"]}
        for kind, fmt in zip(("gate_up", "down"), formats[i]):
            for name in names[kind]:
                t = weights.get(name)
                w = t.dequantize_rows(torch.arange(min(rows, t.shape[0])))
                if fmt == "int4" and not int4_fits(16, w.shape[1]):
                    fmt = "int8"  # what HotFFNWeights falls back to
                w = w[:, : w.shape[1] - w.shape[1] % INT4_GROUP] if fmt == "int4" else w
                out[kind] = max(out[kind], conversion_error(w, fmt, half))
    return out


def sampled_attention_error(weights, n_layers: int, dtype: torch.dtype,
                            rows: int = 64) -> dict[str, float]:
    """What storing attention in `dtype` loses against the file's values: the relative
    error of `rows` rows of q/k/v ("qkv") and of the output projection ("o"), first, middle
    and last layers (max over them). For `ember info`, which loads no model."""
    out = {"qkv": 0.0, "o": 0.0}
    for i in sorted({0, n_layers // 2, n_layers - 1}):
        names = {"qkv": [f"blk.{i}.attn_{n}.weight" for n in "qkv"],
                 "o": [f"blk.{i}.attn_output.weight"]}
        for kind, tensors in names.items():
            for name in tensors:
                t = weights.get(name)
                w = t.dequantize_rows(torch.arange(min(rows, t.shape[0])))
                out[kind] = max(out[kind], conversion_error(w, dtype_name(dtype), dtype))
    return out
