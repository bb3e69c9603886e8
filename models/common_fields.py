"""The hyper-parameters every family reads the same way, from GGUF or from config.json.

Families add what is theirs (activation, norms, windows) on top of these keyword arguments
for `ModelConfig`.
"""

from __future__ import annotations

from .support.errors import ModelFormatError
from .fields import typed
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .rotary import llama3_rope_factors, yarn_attn_factor, yarn_rope_factors

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
        value = f.arch_field(key, int) if default is None else f.arch_field(key, int, default)
        return _size(f.path, f"metadata '{a}{key}'", value, limit)

    hidden = size("embedding_length")
    n_heads = size("attention.head_count")
    head_dim = size("attention.key_length", hidden // n_heads)
    value_dim = f.arch_field("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise ModelFormatError(f.path, f"metadata '{a}attention.value_length' ({value_dim}) differs "
                                       f"from the key length ({head_dim}); Ember needs them equal")
    rotated = f.arch_field("rope.dimension_count", int, head_dim)
    if rotated != head_dim:  # partial rotary (some Phi / GPT-NeoX files): not implemented
        raise ModelFormatError(f.path, f"metadata '{a}rope.dimension_count' is {rotated}: RoPE on "
                                       f"part of each {head_dim}-value head is not supported")
    scaling = f.arch_field("rope.scaling.type", str, "none")
    if scaling not in GGUF_ROPE_SCALINGS:
        raise ModelFormatError(f.path, f"RoPE scaling '{scaling}' (metadata '{a}rope.scaling.type') "
                                       f"is not supported (supported: {', '.join(GGUF_ROPE_SCALINGS)})")
    rope_base = f.arch_field("rope.freq_base", float, rope_base)
    context = size("context_length")
    # llama.cpp multiplies cos and sin by this in every family (LongRoPE files carry one).
    attn_factor = _positive(f, "rope.scaling.attn_factor",
                            f.arch_field("rope.scaling.attn_factor", float, 1.0))
    factors = _gguf_rope_factors(f, head_dim)
    if scaling == "yarn":
        factors, yarn_attn = _gguf_yarn(f, head_dim, rope_base, context, bool(factors))
        attn_factor *= yarn_attn
    return dict(
        name=f.field("general.name", str, f.architecture),
        vocab_size=vocab_size,
        hidden_size=hidden,
        n_layers=size("block_count", limit=MAX_LAYERS),
        n_heads=n_heads,
        n_kv_heads=size("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn_size=size("feed_forward_length"),
        context_length=context,
        rms_eps=f.arch_field("attention.layer_norm_rms_epsilon", float, rms_eps),
        rope_base=rope_base,
        rope_scale=f.arch_field("rope.scaling.factor", float, 1.0) if scaling == "linear" else 1.0,
        rope_factors=factors,
        rope_attn_factor=attn_factor,
        tied_embeddings="output.weight" not in f.tensors,
    )


# Llama 3.1 files carry no scaling type: their scaling is the `rope_freqs` tensor.
GGUF_ROPE_SCALINGS = ("none", "linear", "yarn")


def _positive(f: GGUFFile, key: str, value: float) -> float:
    if not value > 0:  # (also NaN)
        raise ModelFormatError(f.path, f"metadata '{f.architecture}.{key}' must be positive, "
                                       f"got {value}")
    return value


def _gguf_yarn(f: GGUFFile, head_dim: int, base: float, context: int,
               has_rope_freqs: bool) -> tuple[tuple[float, ...], float]:
    """YaRN (rope.scaling.type "yarn"): its per-frequency divisors and cos/sin factor, with
    llama.cpp's defaults (original context: the model's; beta_fast 32, beta_slow 1)."""
    if has_rope_freqs:
        raise ModelFormatError(f.path, "both a 'rope_freqs' tensor and YaRN scaling: which one "
                                       "scales RoPE is ambiguous")
    if f.arch_field("rope.scaling.yarn_log_multiplier", float, 0.0):
        raise ModelFormatError(f.path, "YaRN with a log multiplier (DeepSeek's mscale) is not "
                                       "supported")
    factor = _positive(f, "rope.scaling.factor", f.arch_field("rope.scaling.factor", float))
    original = _positive(f, "rope.scaling.original_context_length",
                         f.arch_field("rope.scaling.original_context_length", int, context))
    fast = _positive(f, "rope.scaling.yarn_beta_fast",
                     f.arch_field("rope.scaling.yarn_beta_fast", float, 32.0))
    slow = _positive(f, "rope.scaling.yarn_beta_slow",
                     f.arch_field("rope.scaling.yarn_beta_slow", float, 1.0))
    return yarn_rope_factors(head_dim, base, factor, original, fast, slow), yarn_attn_factor(factor)


def _gguf_rope_factors(f: GGUFFile, head_dim: int) -> tuple[float, ...]:
    """A `rope_freqs.weight` tensor (Llama 3.1 and later): one divisor per rotary frequency."""
    return gguf_factor_tensor(f, "rope_freqs.weight", head_dim)


def gguf_factor_tensor(f: GGUFFile, name: str, head_dim: int) -> tuple[float, ...]:
    """A tensor of per-frequency RoPE divisors (`rope_freqs`, `rope_factors_long`...), or ()
    when the file has none."""
    info = f.tensors.get(name)
    if info is None:
        return ()
    if info.shape != (head_dim // 2,) or info.qtype != 0:  # F32, as llama.cpp writes it
        raise ModelFormatError(f.path, f"tensor '{name}' must be F32 of shape "
                                       f"({head_dim // 2},), got {info.qtype_name} {info.shape}")
    factors = tuple(float(x) for x in f.raw(name).view("<f4"))
    if not all(x > 0 for x in factors):  # (also NaN)
        raise ModelFormatError(f.path, f"tensor '{name}' must hold positive values")
    return factors


def hf_fields(c: HFConfig, *, rope_base: float, rms_eps: float, tied: bool,
              own_scalings: tuple[str, ...] = ()) -> dict:
    """`own_scalings`: `rope_scaling` types the family reads itself (Phi-3's LongRoPE)."""

    def size(key: str, default: int | None = None, limit: int = MAX_SIZE) -> int:
        value = c.field(key, int) if default is None else c.field(key, int, default)
        return _size(c.path, f"'{key}'", value, limit)

    hidden = size("hidden_size")
    n_heads = size("num_attention_heads")
    head_dim = size("head_dim", hidden // n_heads)
    scaling = c.field("rope_scaling", dict, None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in HF_ROPE_SCALINGS + own_scalings:
        raise ModelFormatError(c.path, f"'rope_scaling' type {kind!r} is not supported "
                                       f"(supported: {', '.join(HF_ROPE_SCALINGS + own_scalings)})")
    factor = typed(c.path, "'rope_scaling.factor'", scaling.get("factor", 1.0), float)
    if not factor > 0:
        raise ModelFormatError(c.path, f"'rope_scaling.factor' must be positive, got {factor}")
    linear = kind == "linear"
    return dict(
        name=c.folder.name,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        n_layers=size("num_hidden_layers", limit=MAX_LAYERS),
        n_heads=n_heads,
        n_kv_heads=size("num_key_value_heads", n_heads),
        head_dim=head_dim,
        ffn_size=size("intermediate_size"),
        context_length=size("max_position_embeddings"),
        rms_eps=c.field("rms_norm_eps", float, rms_eps),
        rope_base=c.field("rope_theta", float, rope_base),
        rope_scale=factor if linear else 1.0,
        rope_factors=(_llama3_factors(c, scaling, factor, head_dim,
                                      c.field("rope_theta", float, rope_base))
                      if kind == "llama3" else ()),
        tied_embeddings=c.field("tie_word_embeddings", bool, tied),
    )


HF_ROPE_SCALINGS = ("default", "linear", "llama3")


def require_silu(c: HFConfig) -> None:
    """SwiGLU families: config.json's `hidden_act` must be silu (the default)."""
    hidden_act = c.field("hidden_act", str, "silu")
    if hidden_act != "silu":
        raise ModelFormatError(c.path, f"'hidden_act' {hidden_act!r} is not supported (silu)")


def _llama3_factors(c: HFConfig, scaling: dict, factor: float, head_dim: int,
                    base: float) -> tuple[float, ...]:
    """config.json's `rope_scaling` (rope_type llama3) as per-frequency divisors."""
    def number(key: str, default: float) -> float:
        value = typed(c.path, f"'rope_scaling.{key}'", scaling.get(key, default), float)
        if not value > 0:
            raise ModelFormatError(c.path, f"'rope_scaling.{key}' must be positive, got {value}")
        return value

    low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
    original = number("original_max_position_embeddings", 8192)
    if not high > low:
        raise ModelFormatError(c.path, "'rope_scaling.high_freq_factor' must exceed "
                                       "'low_freq_factor'")
    return llama3_rope_factors(head_dim, base, factor, low, high, original)
