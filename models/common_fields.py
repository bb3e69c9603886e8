"""The hyper-parameters every family reads the same way, from GGUF or from config.json.

Families add what is theirs (activation, norms, windows) on top of these keyword arguments
for `ModelConfig`.
"""

from __future__ import annotations

from .gguf_file import GGUFFile
from .hf_config import HFConfig


def gguf_fields(f: GGUFFile, vocab_size: int, *, rope_base: float, rms_eps: float) -> dict:
    a = f.architecture + "."
    hidden = f.field(a + "embedding_length", int)
    n_heads = f.field(a + "attention.head_count", int)
    scaling = f.field(a + "rope.scaling.type", str, "none")
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        n_layers=f.field(a + "block_count", int),
        n_heads=n_heads,
        n_kv_heads=f.field(a + "attention.head_count_kv", int, n_heads),
        head_dim=f.field(a + "attention.key_length", int, hidden // max(n_heads, 1)),
        ffn_size=f.field(a + "feed_forward_length", int),
        context_length=f.field(a + "context_length", int),
        rms_eps=f.field(a + "attention.layer_norm_rms_epsilon", float, rms_eps),
        rope_base=f.field(a + "rope.freq_base", float, rope_base),
        rope_scale=f.field(a + "rope.scaling.factor", float, 1.0) if scaling == "linear" else 1.0,
        tied_embeddings="output.weight" not in f.tensors,
    )


def hf_fields(c: HFConfig, *, rope_base: float, rms_eps: float, tied: bool) -> dict:
    hidden = c.field("hidden_size", int)
    n_heads = c.field("num_attention_heads", int)
    scaling = c.field("rope_scaling", dict, None) or {}
    linear = scaling.get("rope_type", scaling.get("type")) == "linear"
    return dict(
        name=c.folder.name,
        vocab_size=c.field("vocab_size", int),
        hidden_size=hidden,
        n_layers=c.field("num_hidden_layers", int),
        n_heads=n_heads,
        n_kv_heads=c.field("num_key_value_heads", int, n_heads),
        head_dim=c.field("head_dim", int, hidden // max(n_heads, 1)),
        ffn_size=c.field("intermediate_size", int),
        context_length=c.field("max_position_embeddings", int),
        rms_eps=c.field("rms_norm_eps", float, rms_eps),
        rope_base=c.field("rope_theta", float, rope_base),
        rope_scale=float(scaling.get("factor", 1.0)) if linear else 1.0,
        tied_embeddings=c.field("tie_word_embeddings", bool, tied),
    )
