"""Gemma 3: GeGLU (gelu-tanh) FFN, q/k RMSNorm, sandwich norms, GQA, interleaved
sliding-window (local) and global attention layers, embeddings scaled by sqrt(hidden), tied LM
head.

Facts not stored in GGUF metadata: every 6th layer is global (layers 5, 11, 17, ...); local
layers use RoPE base 10,000; the attention scale is 1/sqrt(head_dim) except for the 27B model,
which uses 1/sqrt(hidden / heads). GGUF stores norm weights already as (1 + w); Hugging Face
checkpoints store w, so the HF path adds 1.
"""

from __future__ import annotations

import math

import torch

from .common_fields import gguf_fields, hf_fields
from .config import ModelConfig
from .support.errors import ModelFormatError
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name

LOCAL_ROPE_BASE = 10_000.0
GLOBAL_EVERY = 6


def _attn_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    if n_layers == 62:  # Gemma 3 27B: query_pre_attn_scalar = hidden / heads
        return (hidden / n_heads) ** -0.5
    return head_dim ** -0.5


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    common = gguf_fields(f, vocab_size, rope_base=1_000_000.0, rms_eps=1e-6)
    pattern = f.arch_field("attention.sliding_window_pattern", int, GLOBAL_EVERY)
    window = f.arch_field("attention.sliding_window", int, 512)
    return ModelConfig(
        architecture="gemma3",
        local_rope_base=LOCAL_ROPE_BASE,
        final_logit_softcap=f.arch_field("final_logit_softcapping", float, None),
        **_gemma_fields(common, window, pattern),
    )


def config_from_hf(c: HFConfig) -> ModelConfig:
    common = hf_fields(c, rope_base=1_000_000.0, rms_eps=1e-6, tied=True)
    fields = _gemma_fields(common, c.field("sliding_window", int, 512),
                           c.field("sliding_window_pattern", int, GLOBAL_EVERY))
    if "query_pre_attn_scalar" in c.data:
        scalar = c.field("query_pre_attn_scalar", float)
        if not scalar > 0:  # the scale is its inverse square root
            raise ModelFormatError(c.path,
                                   f"'query_pre_attn_scalar' must be positive, got {scalar}")
        fields["attn_scale"] = scalar ** -0.5
    return ModelConfig(
        architecture="gemma3",
        local_rope_base=c.field("rope_local_base_freq", float, LOCAL_ROPE_BASE),
        final_logit_softcap=c.field("final_logit_softcapping", float, None),
        **fields,
    )


def _gemma_fields(common: dict, window: int, pattern: int) -> dict:
    """What every Gemma 3 has, whatever the file format."""
    n_layers, hidden = common["n_layers"], common["hidden_size"]
    return dict(
        common,
        activation="gelu_glu",
        sliding_window=tuple(None if (i + 1) % max(pattern, 1) == 0 else window
                             for i in range(n_layers)),
        attn_scale=_attn_scale(n_layers, hidden, common["n_heads"], common["head_dim"]),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
    )


_HF_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def hf_tensor_name(name: str) -> str | None:
    """Canonical (GGUF-style) name for a Hugging Face tensor name, None if unused."""
    return canonical_name(name, _HF_LAYER_NAMES)


def hf_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Gemma's HF norms hold w where the model multiplies by (1 + w); GGUF stores 1 + w."""
    return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
