"""Qwen 2 / 2.5 and Qwen 3: LLaMA-shaped decoders (pre-norm, GQA, SwiGLU, untied or tied
LM head) that rotate the two halves of each head (llama.cpp's NEOX RoPE: their GGUF q/k rows
are stored as Hugging Face has them, not permuted).

Qwen 2 adds a bias to each of the q, k and v projections (`attn_q.bias`...); Qwen 3 has no
biases but RMS-normalizes every q and k head before RoPE (`attn_q_norm`, `attn_k_norm`, as
Gemma 3 does). Neither GGUF nor llama.cpp uses Qwen 2's optional sliding window, so a
`config.json` that turns it on is refused rather than run without it.
"""

from __future__ import annotations

import torch

from .common_fields import gguf_fields, hf_fields, require_silu
from .config import ModelConfig
from .support.errors import ModelFormatError
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name

QWEN3 = ("qwen3",)


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    arch = f.architecture
    common = gguf_fields(f, vocab_size, rope_base=10_000.0, rms_eps=1e-6)
    has_bias = "blk.0.attn_q.bias" in f.tensors
    if arch in QWEN3 and has_bias:
        raise ModelFormatError(f.path, "a qwen3 file with q/k/v biases: Qwen 3 has none")
    if arch not in QWEN3 and not has_bias:
        raise ModelFormatError(f.path, "tensor 'blk.0.attn_q.bias' is missing (Qwen 2 has "
                                       "q/k/v biases)")
    return ModelConfig(architecture=arch, **_qwen_fields(arch, common))


def config_from_hf(c: HFConfig) -> ModelConfig:
    common = hf_fields(c, rope_base=10_000.0, rms_eps=1e-6, tied=False)
    if c.field("use_sliding_window", bool, False):
        raise ModelFormatError(c.path, "'use_sliding_window' is true: Qwen's sliding-window "
                                       "attention is not supported (llama.cpp does not run it)")
    require_silu(c)
    return ModelConfig(architecture=c.model_type, **_qwen_fields(c.model_type, common))


def _qwen_fields(arch: str, common: dict) -> dict:
    qwen3 = arch in QWEN3
    return dict(common, activation="silu_glu", rope_interleaved=False, qk_norm=qwen3,
                qkv_bias=not qwen3)


_HF_LAYER_NAMES = {
    **COMMON_LAYER_NAMES,
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def hf_tensor_name(name: str) -> str | None:
    """Canonical (GGUF-style) name for a Hugging Face tensor name, None if unused."""
    return canonical_name(name, _HF_LAYER_NAMES)


def hf_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor
