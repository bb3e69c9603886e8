"""The hyper-parameters every family reads the same way, from GGUF or from config.json.

Families add what is theirs (activation, norms, windows) on top of these keyword arguments
for `ModelConfig`.
"""

from __future__ import annotations

from .errors import ModelFormatError
from .fields import typed
from .gguf_file import GGUFFile
from .hf_config import HFConfig

# Families and the model constructor compute with these before any tensor shape is checked
# (head_dim ** -0.5, a tuple per layer, rotary tables of head_dim / 2), so they are bounded
# where they are read. The largest models have ~130 layers; no dimension comes near 2**31
# (torch sizes overflow at 2**63, and 2**31 keeps products of two sizes inside int64).
MAX_LAYERS = 4096
MAX_SIZE = 2**31 - 1


def _size(path, what: str, value: int, limit: int = MAX_SIZE) -> int:
    if not 0 < value <= limit:
        raise ModelFormatError(path, f"{what} must be between 1 and {limit}, got {value}")
    return value


def gguf_fields(f: GGUFFile, vocab_size: int, *, rope_base: float, rms_eps: float) -> dict:
    a = f.architecture + "."

    def size(key: str, default: int | None = None, limit: int = MAX_SIZE) -> int:
        value = f.field(a + key, int) if default is None else f.field(a + key, int, default)
        return _size(f.path, f"metadata '{a}{key}'", value, limit)

    hidden = size("embedding_length")
    n_heads = size("attention.head_count")
    scaling = f.field(a + "rope.scaling.type", str, "none")
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        n_layers=size("block_count", limit=MAX_LAYERS),
        n_heads=n_heads,
        n_kv_heads=size("attention.head_count_kv", n_heads),
        head_dim=size("attention.key_length", hidden // n_heads),
        ffn_size=size("feed_forward_length"),
        context_length=size("context_length"),
        rms_eps=f.field(a + "attention.layer_norm_rms_epsilon", float, rms_eps),
        rope_base=f.field(a + "rope.freq_base", float, rope_base),
        rope_scale=f.field(a + "rope.scaling.factor", float, 1.0) if scaling == "linear" else 1.0,
        tied_embeddings="output.weight" not in f.tensors,
    )


def hf_fields(c: HFConfig, *, rope_base: float, rms_eps: float, tied: bool) -> dict:

    def size(key: str, default: int | None = None, limit: int = MAX_SIZE) -> int:
        value = c.field(key, int) if default is None else c.field(key, int, default)
        return _size(c.path, f"'{key}'", value, limit)

    hidden = size("hidden_size")
    n_heads = size("num_attention_heads")
    scaling = c.field("rope_scaling", dict, None) or {}
    linear = scaling.get("rope_type", scaling.get("type")) == "linear"
    factor = typed(c.path, "'rope_scaling.factor'", scaling.get("factor", 1.0), float)
    return dict(
        name=c.folder.name,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        n_layers=size("num_hidden_layers", limit=MAX_LAYERS),
        n_heads=n_heads,
        n_kv_heads=size("num_key_value_heads", n_heads),
        head_dim=size("head_dim", hidden // n_heads),
        ffn_size=size("intermediate_size"),
        context_length=size("max_position_embeddings"),
        rms_eps=c.field("rms_norm_eps", float, rms_eps),
        rope_base=c.field("rope_theta", float, rope_base),
        rope_scale=factor if linear else 1.0,
        tied_embeddings=c.field("tie_word_embeddings", bool, tied),
    )
