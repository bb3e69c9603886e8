"""Gemma 2: Gemma 3's layout (GeGLU FFN, sandwich norms, embeddings scaled by sqrt(hidden),
tied LM head) without q/k norms, with soft-capped attention scores and final logits, and
sliding-window (local) and global attention layers alternating: even layers local (0, 2, ...).

Facts not always in the metadata, as llama.cpp takes them: a 4096-token window, caps of 50
(attention) and 30 (logits), one RoPE base for every layer, and the attention scale
1/sqrt(head_dim) except for the 46-layer 27B, which uses 1/sqrt(hidden / heads). GGUF stores
norm weights as (1 + w), Hugging Face checkpoints as w (the HF path adds 1, as for Gemma 3).
"""

from __future__ import annotations

import math

from .common_fields import gguf_fields, hf_fields
from .config import ModelConfig
from .support.errors import ModelFormatError
from .gemma3 import hf_transform  # noqa: F401  (the same (1 + w) norms)
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name

WINDOW = 4096
ATTN_SOFTCAP, FINAL_SOFTCAP = 50.0, 30.0
LAYERS_27B = 46


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    common = gguf_fields(f, vocab_size, rope_base=10_000.0, rms_eps=1e-6)
    n_layers, hidden, n_heads = common["n_layers"], common["hidden_size"], common["n_heads"]
    scale = (hidden / n_heads if n_layers == LAYERS_27B else common["head_dim"]) ** -0.5
    return ModelConfig(
        architecture="gemma2",
        attn_scale=scale,
        attn_softcap=f.arch_field("attn_logit_softcapping", float, ATTN_SOFTCAP),
        final_logit_softcap=f.arch_field("final_logit_softcapping", float, FINAL_SOFTCAP),
        **_gemma2_fields(common, f.arch_field("attention.sliding_window", int, WINDOW)),
    )


def config_from_hf(c: HFConfig) -> ModelConfig:
    common = hf_fields(c, rope_base=10_000.0, rms_eps=1e-6, tied=True)
    scalar = c.field("query_pre_attn_scalar", float, float(common["head_dim"]))
    if not scalar > 0:  # the scale is its inverse square root
        raise ModelFormatError(c.path, f"'query_pre_attn_scalar' must be positive, got {scalar}")
    return ModelConfig(
        architecture="gemma2",
        attn_scale=scalar ** -0.5,
        attn_softcap=_hf_cap(c, "attn_logit_softcapping", ATTN_SOFTCAP),
        final_logit_softcap=_hf_cap(c, "final_logit_softcapping", FINAL_SOFTCAP),
        **_gemma2_fields(common, c.field("sliding_window", int, WINDOW)),
    )


def _hf_cap(c: HFConfig, key: str, default: float) -> float | None:
    """A cap from config.json: absent means transformers' Gemma2Config default, null none."""
    if key in c.data and c.data[key] is None:
        return None
    return c.field(key, float, default)


def _gemma2_fields(common: dict, window: int) -> dict:
    n_layers = common["n_layers"]
    return dict(
        common,
        activation="gelu_glu",
        sliding_window=tuple(window if i % 2 == 0 else None for i in range(n_layers)),
        sandwich_norms=True,
        embed_scale=math.sqrt(common["hidden_size"]),
    )


_HF_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def hf_tensor_name(name: str) -> str | None:
    """Canonical (GGUF-style) name for a Hugging Face tensor name, None if unused."""
    return canonical_name(name, _HF_LAYER_NAMES)
