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

from .config import ModelConfig
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name

LOCAL_ROPE_BASE = 10_000.0
GLOBAL_EVERY = 6


def _layer_windows(n_layers: int, window: int, pattern: int) -> tuple[int | None, ...]:
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(n_layers))


def _attn_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    if n_layers == 62:  # Gemma 3 27B: query_pre_attn_scalar = hidden / heads
        return (hidden / n_heads) ** -0.5
    return head_dim ** -0.5


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    a = "gemma3."
    n_layers = f.field(a + "block_count", int)
    hidden = f.field(a + "embedding_length", int)
    n_heads = f.field(a + "attention.head_count", int)
    head_dim = f.field(a + "attention.key_length", int, hidden // max(n_heads, 1))
    pattern = f.field(a + "attention.sliding_window_pattern", int, GLOBAL_EVERY)
    scaling = f.field(a + "rope.scaling.type", str, "none")
    return ModelConfig(
        architecture="gemma3",
        name=f.field("general.name", str, "gemma3"),
        vocab_size=vocab_size,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=f.field(a + "attention.head_count_kv", int, n_heads),
        head_dim=head_dim,
        ffn_size=f.field(a + "feed_forward_length", int),
        context_length=f.field(a + "context_length", int),
        activation="gelu_glu",
        rms_eps=f.field(a + "attention.layer_norm_rms_epsilon", float, 1e-6),
        rope_base=f.field(a + "rope.freq_base", float, 1_000_000.0),
        rope_scale=f.field(a + "rope.scaling.factor", float, 1.0) if scaling == "linear" else 1.0,
        sliding_window=_layer_windows(n_layers, f.field(a + "attention.sliding_window", int, 512),
                                      max(pattern, 1)),
        local_rope_base=LOCAL_ROPE_BASE,
        attn_scale=_attn_scale(n_layers, hidden, n_heads, head_dim),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
        tied_embeddings="output.weight" not in f.tensors,
        final_logit_softcap=f.field(a + "final_logit_softcapping", float, None),
    )


def config_from_hf(c: HFConfig) -> ModelConfig:
    n_layers = c.field("num_hidden_layers", int)
    hidden = c.field("hidden_size", int)
    n_heads = c.field("num_attention_heads", int)
    head_dim = c.field("head_dim", int, hidden // max(n_heads, 1))
    pattern = c.field("sliding_window_pattern", int, GLOBAL_EVERY)
    rope_scaling = c.field("rope_scaling", dict, None) or {}
    query_scalar = c.field("query_pre_attn_scalar", float, head_dim)
    return ModelConfig(
        architecture="gemma3",
        name=c.path.name,
        vocab_size=c.field("vocab_size", int),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=c.field("num_key_value_heads", int, n_heads),
        head_dim=head_dim,
        ffn_size=c.field("intermediate_size", int),
        context_length=c.field("max_position_embeddings", int),
        activation="gelu_glu",
        rms_eps=c.field("rms_norm_eps", float, 1e-6),
        rope_base=c.field("rope_theta", float, 1_000_000.0),
        rope_scale=float(rope_scaling.get("factor", 1.0)) if rope_scaling.get("rope_type") == "linear" else 1.0,
        sliding_window=_layer_windows(n_layers, c.field("sliding_window", int, 512), max(pattern, 1)),
        local_rope_base=c.field("rope_local_base_freq", float, LOCAL_ROPE_BASE),
        attn_scale=query_scalar ** -0.5,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
        tied_embeddings=c.field("tie_word_embeddings", bool, True),
        final_logit_softcap=c.field("final_logit_softcapping", float, None),
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
