"""The architecture-independent description of a decoder-only transformer.

Each family module (`gemma3.py`, `llama.py`) fills a `ModelConfig` from a GGUF file's metadata
or a Hugging Face `config.json`; the runtime reads only this dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .activations import TABLE as _ACTIVATION_TABLE
from .activations import is_gated

# FFN activations (the table: activations.py). Gated: down(act(gate x, up x)); plain:
# down(act(up x)), no gate (OPT-style MLP).
GATED_ACTIVATIONS = tuple(a.name for a in _ACTIVATION_TABLE if a.gated)
PLAIN_ACTIVATIONS = tuple(a.name for a in _ACTIVATION_TABLE if not a.gated)
ACTIVATIONS = GATED_ACTIVATIONS + PLAIN_ACTIVATIONS


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model. Validates itself; errors name the offending field."""

    architecture: str  # registry key, e.g. "gemma3" or "llama"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    context_length: int
    activation: str
    rms_eps: float = 1e-6
    rope_base: float = 10_000.0
    rope_scale: float = 1.0  # linear position scaling (positions divided by this)
    # Per rotary frequency divisors (head_dim / 2 of them; empty: none): Llama 3.1's scaling,
    # from a GGUF file's `rope_freqs` tensor or config.json's `rope_scaling` (rope_type llama3).
    rope_factors: tuple[float, ...] = ()
    # Phi-3 LongRoPE (rope_factors is then its short set): a context longer than
    # rope_original_context rotates with rope_factors_long instead, as llama.cpp chooses by
    # its context size; rope_attn_factor multiplies cos and sin (so q.k by its square).
    rope_factors_long: tuple[float, ...] = ()
    rope_original_context: int = 0
    rope_attn_factor: float = 1.0
    # Rotary layout: False rotates the two halves of each head (HF / "NEOX"), True rotates
    # adjacent pairs (what llama.cpp's LLaMA GGUFs expect, their q/k rows are permuted).
    rope_interleaved: bool = False
    # Sliding-window attention: per layer, None for global attention or the window length.
    sliding_window: tuple[int | None, ...] = ()
    local_rope_base: float | None = None  # RoPE base of sliding-window layers, if different
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    qk_norm: bool = False
    qkv_bias: bool = False  # Qwen 2: the q, k and v projections add a bias
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    sandwich_norms: bool = False  # Gemma: extra norms after attention and after the FFN
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden)
    tied_embeddings: bool = True
    final_logit_softcap: float | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "ffn_size", "context_length")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.sliding_window and len(self.sliding_window) != self.n_layers:
            raise ValueError(
                f"sliding_window lists {len(self.sliding_window)} layers, model has {self.n_layers}"
            )
        # A window of 0 keys leaves a query nothing to attend to (NaN outputs); one past int64
        # overflows the mask arithmetic. 2**31 - 1 is the cap every other size has too.
        bad_windows = [w for w in self.sliding_window if w is not None and not 1 <= w < 2**31]
        if bad_windows:
            raise ValueError(f"sliding window sizes must be between 1 and 2**31 - 1, "
                             f"got {bad_windows[0]}")
        if self.rope_scale <= 0 or self.rope_base <= 0:
            raise ValueError("rope_base and rope_scale must be positive")
        if self.rope_factors and (len(self.rope_factors) != self.head_dim // 2
                                  or not all(f > 0 for f in self.rope_factors)):
            raise ValueError(f"rope_factors must be {self.head_dim // 2} positive numbers "
                             f"(head_dim / 2), got {len(self.rope_factors)}")
        self._check_longrope()
        for name in ("attn_softcap", "final_logit_softcap"):
            cap = getattr(self, name)
            if cap is not None and not cap >= 0:  # 0 (as None): no capping
                raise ValueError(f"{name} must not be negative, got {cap}")

    def _check_longrope(self) -> None:
        if self.rope_factors_long:
            if (len(self.rope_factors_long) != self.head_dim // 2
                    or not all(f > 0 for f in self.rope_factors_long)):
                raise ValueError(f"rope_factors_long must be {self.head_dim // 2} positive "
                                 f"numbers (head_dim / 2), got {len(self.rope_factors_long)}")
            if not self.rope_factors or self.rope_original_context <= 0:
                raise ValueError("rope_factors_long needs the short set (rope_factors) and a "
                                 "positive rope_original_context")
        if not self.rope_attn_factor > 0:
            raise ValueError(f"rope_attn_factor must be positive, got {self.rope_attn_factor}")

    def rope_factors_for(self, n_ctx: int | None) -> tuple[float, ...]:
        """The frequency divisors a context of `n_ctx` tokens rotates with: LongRoPE's long
        set past the original context, else rope_factors (None: a context within it)."""
        if self.rope_factors_long and n_ctx is not None and n_ctx > self.rope_original_context:
            return self.rope_factors_long
        return self.rope_factors

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    def window(self, layer: int) -> int | None:
        return self.sliding_window[layer] if self.sliding_window else None

    def layer_rope_base(self, layer: int) -> float:
        if self.window(layer) is not None and self.local_rope_base is not None:
            return self.local_rope_base
        return self.rope_base

    def layer_rope_scale(self, layer: int) -> float:
        """Gemma 3's local layers keep their own RoPE unscaled (as in the HF model and
        llama.cpp); every other layer divides positions by rope_scale."""
        if self.window(layer) is not None and self.local_rope_base is not None:
            return 1.0
        return self.rope_scale

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5
