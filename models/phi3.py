"""Phi-3 (mini, medium) and Phi-3.5 mini: a LLaMA-shaped decoder
(pre-norm, SwiGLU, RoPE on the two halves of each head) whose files fuse projections:
`attn_qkv` holds the q, k and v rows one after the other and `ffn_up` the gate rows then the
up rows (2 * ffn_size of them).

Ember reads the fused tensors as row views (`unfuse`): `attn_q`, `attn_k`, `attn_v`,
`ffn_gate` and `ffn_up` are slices of the file's own blocks, so every runtime path sees the
usual names and nothing is copied.

llama.cpp runs Phi-3 without its sliding window ("Phi SWA is currently disabled"), so Ember
ignores `phi3.attention.sliding_window` too: the two engines compute the same function.

The 128k-context files (Phi-3-*-128k, Phi-3.5) scale RoPE with LongRoPE: two sets of
per-frequency divisors (`rope_factors_short` / `rope_factors_long`, F32) and an attention
factor (`rope.scaling.attn_factor`, the converter's sqrt(1 + ln(s) / ln(original)) for
s = context / original context) that multiplies cos and sin. As llama.cpp does, the set is
chosen once by the context size, not per position: a context longer than the original one
(`rope.scaling.original_context_length`) uses the long set, every position of it.
Hugging Face's `rope_scaling` (type "longrope" or "su") gives the same numbers.
"""

from __future__ import annotations

import math

import torch

from .common_fields import gguf_factor_tensor, gguf_fields, hf_fields, require_silu
from .config import ModelConfig
from .support.errors import ModelFormatError
from .fields import typed
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name
from .weights import WeightStore

LONGROPE_TYPES = ("longrope", "su")


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    common = gguf_fields(f, vocab_size, rope_base=10_000.0, rms_eps=1e-5)
    return ModelConfig(architecture="phi3", activation="silu_glu", rope_interleaved=False,
                       **{**common, **_gguf_longrope(f, common)})


def _gguf_longrope(f: GGUFFile, common: dict) -> dict:
    """LongRoPE's fields from a GGUF file (none when it has no factor tensors)."""
    hd = common["head_dim"]
    short = gguf_factor_tensor(f, "rope_factors_short.weight", hd)
    long = gguf_factor_tensor(f, "rope_factors_long.weight", hd)
    if not short and not long:
        return {}
    if not short or not long:
        missing = "rope_factors_long" if short else "rope_factors_short"
        raise ModelFormatError(f.path, f"tensor '{missing}.weight' is missing (LongRoPE "
                                       f"needs both factor sets)")
    if common["rope_factors"]:
        raise ModelFormatError(f.path, "both 'rope_freqs' and LongRoPE factor tensors: which "
                                       "one scales RoPE is ambiguous")
    original = f.arch_field("rope.scaling.original_context_length", int, common["context_length"])
    # (rope.scaling.attn_factor, read for every family, is already in `common`.)
    return dict(rope_factors=short, rope_factors_long=long,
                rope_original_context=_positive(f.path, "phi3.rope.scaling.original_context_length",
                                                original))


def config_from_hf(c: HFConfig) -> ModelConfig:
    common = hf_fields(c, rope_base=10_000.0, rms_eps=1e-5, tied=False,
                       own_scalings=LONGROPE_TYPES)
    require_silu(c)
    return ModelConfig(architecture="phi3", activation="silu_glu", rope_interleaved=False,
                       **{**common, **_hf_longrope(c, common)})


def _hf_longrope(c: HFConfig, common: dict) -> dict:
    """config.json's `rope_scaling` of type longrope: the converter's numbers."""
    scaling = c.field("rope_scaling", dict, None) or {}
    if scaling.get("rope_type", scaling.get("type")) not in LONGROPE_TYPES:
        return {}
    hd, context = common["head_dim"], common["context_length"]

    def factors(key: str) -> tuple[float, ...]:
        values = typed(c.path, f"'rope_scaling.{key}'", scaling.get(key), list)
        values = tuple(typed(c.path, f"'rope_scaling.{key}'", v, float) for v in values)
        if len(values) != hd // 2 or not all(v > 0 for v in values):
            raise ModelFormatError(c.path, f"'rope_scaling.{key}' must be {hd // 2} positive "
                                           f"numbers (head_dim / 2)")
        return values

    original = _positive(c.path, "original_max_position_embeddings",
                         c.field("original_max_position_embeddings", int, context))
    attn = scaling.get("attention_factor")
    if attn is None:  # what transformers and llama.cpp's converter derive
        s = context / original
        attn = math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0
    attn = _positive(c.path, "rope_scaling.attention_factor",
                     typed(c.path, "'rope_scaling.attention_factor'", attn, float))
    return dict(rope_factors=factors("short_factor"), rope_factors_long=factors("long_factor"),
                rope_original_context=original, rope_attn_factor=attn)


def _positive(path, key: str, value):
    if not value > 0:  # (also NaN)
        raise ModelFormatError(path, f"'{key}' must be positive, got {value}")
    return value


def unfuse(w: WeightStore, cfg: ModelConfig) -> WeightStore:
    """The fused tensors' parts under the usual names, as row views of the same bytes."""
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    changes = {}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        if p + "attn_qkv.weight" in w:
            qkv = w.get(p + "attn_qkv.weight", (q + 2 * kv, h))
            changes.update({p + "attn_qkv.weight": None,
                            p + "attn_q.weight": qkv.row_slice(0, q),
                            p + "attn_k.weight": qkv.row_slice(q, q + kv),
                            p + "attn_v.weight": qkv.row_slice(q + kv, q + 2 * kv)})
        if p + "ffn_gate.weight" not in w:
            up = w.get(p + "ffn_up.weight", (2 * f, h))
            changes.update({p + "ffn_gate.weight": up.row_slice(0, f),
                            p + "ffn_up.weight": up.row_slice(f, 2 * f)})
    return w.replaced(changes)


_HF_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def hf_tensor_name(name: str) -> str | None:
    """Canonical (GGUF-style) name for a Hugging Face tensor name, None if unused."""
    return canonical_name(name, _HF_LAYER_NAMES)


def hf_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor
