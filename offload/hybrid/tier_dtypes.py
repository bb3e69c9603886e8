"""Which format each matrix takes on the GPU tier.

By default (`--tier-dtype auto` or `file`) every matrix keeps the file's own GGML blocks
(kernels/tier_blocks.py: the file's bytes and values, format "file:<types>"). The older
re-quantized formats stay selectable by name (kernels/tier_weights.py); "auto" falls back to
them only for rows that come from the float32 reference (whose file types are gone), per
tensor from its file type and the device's capability:

    Q4-family and lower (Q4_0/1, Q4_K, IQ4, Q2_K, Q3_K, IQ1-3)   int4 (32-value groups)
    Q5_*, Q6_K, Q8_*                                              int8 (per-row scales)
    F16 / BF16 / F32                                             fp16 / bf16 / fp16

int4 needs PyTorch's int4 matmul on the device (CUDA sm80+, or the CPU op); without it int4
rows become int8. bf16 needs sm80+ on CUDA (else fp16). Float32 only when asked (`fp32`), or
when the rows come from the float32 reference model (`--weights fp32/q8`), whose file types
are gone. A fused matmul (gate with up) takes the wider of its tensors' formats.

Attention (q/k/v/o and the norms), its KV pool and the LM head go to the tier where the
plan puts them (`--tier-attention auto`: in the file's blocks, K/V in float16), "host" keeps
them on the file's blocks in host RAM, and a named format moves them in it: "file", "int8" or
"int4" (K/V float16, norms float32), "bf16"/"fp16"/"fp32" (K/V and norms in that type too).
`format_table` states, per GGML type of a file, its bits per weight in each tier format and
the error against the file's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels import tier_blocks
from ember.kernels.block_matmul import NATIVE_TYPES
from ember.kernels.hot_ffn import file_format
from ember.kernels.tier_weights import (FORMATS, INT4_GROUP, conversion_error, has_kernel,
                                        int4_fits, linear_bytes, wider)
from ember.models.support.errors import ConfigError
from ember.models.quants import type_name

from ..options.choices import ATTENTION_CHOICES, FILE, TIER_CHOICES

# GGML types the tier keeps as the file's blocks (the ones the kernels read; a file's other
# types are requantized to Q8_0 at load, offload/body/file_layers.py:readable)
BLOCK_TYPE_NAMES = frozenset(type_name(t) for t in NATIVE_TYPES)
_ATTENTION_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TIER_KV_DTYPE = torch.float16  # K/V on the tier beside attention in the file's blocks or codes
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
        """(gate_up's format, down's format) for one layer from its tensors' file types: the
        file's blocks ("file:<types>") by default, where the rows are the file's."""
        if self.choice in ("auto", FILE) and down_type is not None and \
                all(t in BLOCK_TYPE_NAMES for t in (*gate_up_types, down_type)):
            return file_format(list(gate_up_types)), file_format([down_type])
        if self.choice == FILE:
            raise ConfigError("--tier-dtype file keeps the file's blocks, which the float32 "
                              "reference (--weights fp32) does not hold; use auto or a format")
        if self.choice != "auto":
            return self.choice, self.choice
        gu = [format_for_type(t, self.caps) for t in gate_up_types]
        fused = gu[0] if len(gu) == 1 else wider(gu[0], gu[1])
        return fused, format_for_type(down_type, self.caps)


def attention_format(choice: str, device: torch.device) -> str | None:
    """`--tier-attention` resolved against the tier's device: the format attention (and the
    LM head) take there, or None when they stay on the host. "auto": the file's blocks (the
    plan decides whether they move)."""
    if choice not in ATTENTION_CHOICES:
        raise ConfigError(f"unknown --tier-attention {choice!r}; choose one of "
                          f"{', '.join(ATTENTION_CHOICES)}")
    if choice == "host":
        return None
    caps = TierCaps.of(device)
    if choice == "bf16" and caps.half != torch.bfloat16:
        raise ConfigError(f"--tier-attention bf16 is slow or missing on {device}; use fp16")
    if choice == "int4" and not caps.int4:
        raise ConfigError(f"--tier-attention int4 needs PyTorch's int4 matmul on {device} "
                          "(CUDA compute capability 8.0 or later); use file or int8")
    return FILE if choice == "auto" else choice


def attention_kv_dtype(fmt: str) -> torch.dtype:
    """K/V type on the tier beside attention in `fmt` (float16 unless a float format)."""
    return _ATTENTION_TYPES.get(fmt, TIER_KV_DTYPE)


def tier_kv_dtype(fmt: str, device: torch.device, host_kv_dtype: torch.dtype) -> torch.dtype:
    """K/V type of the tier layers' pool: the host's (--kv-type, `host_kv_dtype`) where the
    tier's file blocks run in the C++ pass (a CPU tier: one pool serves every layer), else
    attention's on the tier (`attention_kv_dtype`)."""
    if fmt == FILE and tier_blocks.block_kernels_on(device):
        return host_kv_dtype
    return attention_kv_dtype(fmt)


def attention_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The K/V type attention takes on the tier under `--tier-attention choice` (None: it
    stays on the host)."""
    fmt = attention_format(choice, device)
    return None if fmt is None else attention_kv_dtype(fmt)


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
            if fmt.startswith(FILE):
                continue  # the file's own blocks: its values, error 0
            for name in names[kind]:
                t = weights.get(name)
                w = t.dequantize_rows(torch.arange(min(rows, t.shape[0])))
                if fmt == "int4" and not int4_fits(16, w.shape[1]):
                    fmt = "int8"  # what HotFFNWeights falls back to
                w = w[:, : w.shape[1] - w.shape[1] % INT4_GROUP] if fmt == "int4" else w
                out[kind] = max(out[kind], conversion_error(w, fmt, half))
    return out


def sampled_attention_error(weights, n_layers: int, fmt: str,
                            rows: int = 64) -> dict[str, float]:
    """What storing attention in `fmt` loses against the file's values: the relative
    error of `rows` rows of q/k/v ("qkv") and of the output projection ("o"), first, middle
    and last layers (max over them). For `ember info`, which loads no model."""
    out = {"qkv": 0.0, "o": 0.0}
    if fmt == FILE:
        return out  # the file's own blocks
    for i in sorted({0, n_layers // 2, n_layers - 1}):
        names = {"qkv": [f"blk.{i}.attn_{n}.weight" for n in "qkv"],
                 "o": [f"blk.{i}.attn_output.weight"]}
        for kind, tensors in names.items():
            for name in tensors:
                t = weights.get(name)
                w = t.dequantize_rows(torch.arange(min(rows, t.shape[0])))
                out[kind] = max(out[kind], conversion_error(
                    w, fmt, _ATTENTION_TYPES.get(fmt, torch.bfloat16)))
    return out


def format_table(weights, half: torch.dtype = torch.bfloat16,
                 rows: int = 64) -> dict[str, dict]:
    """Per GGML type of the file's 2-D weights: its bits per weight, and for each tier
    format the bits per weight there and the relative error against the file's values,
    measured on `rows` rows of the first tensor of that type (the file's blocks: the file's
    bits, error 0). For `ember info`: what each format costs on this model."""
    from ember.kernels.tier_blocks import bits_per_weight

    out = {}
    for name in weights.names():
        t = weights.get(name)
        kind = t.qtype_name
        if len(t.shape) != 2 or kind in out or kind not in BLOCK_TYPE_NAMES:
            continue
        w = t.dequantize_rows(torch.arange(min(rows, t.shape[0])))
        n, k = t.shape
        formats = {FILE: {"bits": round(bits_per_weight(t.qtype), 3), "error": 0.0}}
        for fmt in FORMATS:
            if fmt == "int4" and not int4_fits(16, k):
                continue
            bits = 8 * linear_bytes(fmt, n, k, half) / (n * k)
            formats[fmt] = {"bits": round(bits, 3),
                            "error": round(conversion_error(w, fmt, half), 5)}
        out[kind] = {"tensor": name, "bits": formats[FILE]["bits"], "formats": formats}
    return out
