"""Phi-3 (mini, medium; Phi-3.5 mini with LongRoPE refused, see below): a LLaMA-shaped decoder
(pre-norm, SwiGLU, RoPE on the two halves of each head) whose files fuse projections:
`attn_qkv` holds the q, k and v rows one after the other and `ffn_up` the gate rows then the
up rows (2 * ffn_size of them).

Ember reads the fused tensors as row views (`unfuse`): `attn_q`, `attn_k`, `attn_v`,
`ffn_gate` and `ffn_up` are slices of the file's own blocks, so every runtime path sees the
usual names and nothing is copied.

llama.cpp runs Phi-3 without its sliding window ("Phi SWA is currently disabled"), so Ember
ignores `phi3.attention.sliding_window` too: the two engines compute the same function. The
128k-context files (Phi-3-*-128k, Phi-3.5) scale RoPE with LongRoPE factors
(`rope_factors_long` / `rope_factors_short`), which Ember does not implement: they are refused
by name rather than run with the wrong positions.
"""

from __future__ import annotations

import torch

from .common_fields import gguf_fields, hf_fields
from .config import ModelConfig
from .errors import ModelFormatError
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name
from .weights import WeightStore

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    for name in LONGROPE_TENSORS:
        if name in f.tensors or f"blk.0.{name}" in f.tensors:
            raise ModelFormatError(f.path, f"tensor '{name}': Phi-3 LongRoPE scaling (the 128k "
                                           f"context models) is not supported")
    common = gguf_fields(f, vocab_size, rope_base=10_000.0, rms_eps=1e-5)
    return ModelConfig(architecture="phi3", name=f.field("general.name", str, "phi3"),
                       activation="silu_glu", rope_interleaved=False, **common)


def config_from_hf(c: HFConfig) -> ModelConfig:
    scaling = c.field("rope_scaling", dict, None) or {}
    if scaling.get("type", scaling.get("rope_type")) in ("longrope", "su"):
        raise ModelFormatError(c.path, "Phi-3 LongRoPE scaling (the 128k context models) is "
                                       "not supported")
    common = hf_fields(c, rope_base=10_000.0, rms_eps=1e-5, tied=False)
    hidden_act = c.field("hidden_act", str, "silu")
    if hidden_act != "silu":
        raise ModelFormatError(c.path, f"'hidden_act' {hidden_act!r} is not supported (silu)")
    return ModelConfig(architecture="phi3", activation="silu_glu", rope_interleaved=False,
                       **common)


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
