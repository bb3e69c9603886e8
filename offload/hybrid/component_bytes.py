"""What each part of a model takes on the GPU tier, before anything is built: attention and
its KV pool, the LM head, predictors, one more hot FFN neuron per layer in its tier format
(`ComponentBytes`, which `plan_memory` divides the budget by), the host's cold rows and the
tier's working space.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels.hot_ffn import granule, hot_ffn_bytes
from ember.kernels.tier_attention import attention_bytes
from ember.models.config import ModelConfig
from ember.placement.layout import Placement

from ..kv.plan import DEFAULT_PREFILL_CHUNK
from .decode_costs import ModelBytes
from .host_reads import HostReads

FP32 = 4


@dataclass(frozen=True)
class ComponentBytes:
    """Bytes each part takes on whichever tier holds it (fp32 body, as the engine stores it)."""

    attention: int  # all layers' projections and norms, plus the final norm
    kv_pool: int  # the device KV pool
    lm_head: int
    predictors: int
    neuron: tuple[int, ...]  # per layer: one more hot neuron's bytes (the marginal cost)
    # per layer (gate_up's, down's) tier format, and what hot_ffn_bytes needs besides
    formats: tuple[tuple[str, str], ...] = ()
    hidden: int = 0
    gated: bool = True
    half: torch.dtype = torch.bfloat16
    attention_movable: bool = True  # False: attention runs on the host's file blocks
    attention_dtype: torch.dtype = torch.float32  # what attention's tensors take on the tier
    extras_movable: bool = True  # False: the LM head and predictors stay on the host
    host_reads: HostReads | None = None  # given: attention moves only where it pays
    attention_format: str | None = None  # the tier format attention takes (None: its dtype's)
    # Given: every tensor can sit on the tier in the file's bytes, and the plan chooses per
    # layer "gpu", "split" or "cpu" and the LM head (layer_plan.py)
    model: ModelBytes | None = None

    @classmethod
    def estimate(cls, cfg: ModelConfig, kv_pool: int, lm_head: int | None = None,
                 predictors: int = 0, formats: list[tuple[str, str]] | None = None,
                 half: torch.dtype = torch.bfloat16, attention_movable: bool = True,
                 attention_dtype: torch.dtype | None = None, extras_movable: bool = True,
                 host_reads: HostReads | None = None, attention_format: str | None = None,
                 attention: int | None = None) -> "ComponentBytes":
        """lm_head None: the float32 head a GPU tier would hold. formats None: float32 hot
        rows in every layer. attention_dtype None: the float32 model's attention (its
        layers and the final norm); else the tier copies `tier_layers.tier_attention_weights`
        makes, to the byte. `kv_pool`: the device pool's bytes at the K/V type's width.
        `attention` (with `attention_format`): the exact bytes of every layer's tier copies in
        that format (offload/body/tier_layers.py:tier_attention_bytes), given by the caller."""
        if lm_head is None:
            lm_head = cfg.vocab_size * cfg.hidden_size * FP32
        hd, h = cfg.head_dim, cfg.hidden_size
        if attention is None and attention_dtype is None:
            proj = 2 * h * cfg.n_heads * hd + 2 * h * cfg.n_kv_heads * hd
            norms = (4 if cfg.sandwich_norms else 2) * h + (2 * hd if cfg.qk_norm else 0)
            attention = cfg.n_layers * (proj + norms) * FP32 + h * FP32
        elif attention is None:
            attention = cfg.n_layers * attention_bytes(
                h, cfg.n_heads * hd, cfg.n_kv_heads * hd, hd, attention_dtype, cfg.qkv_bias,
                cfg.qk_norm, cfg.sandwich_norms)
        formats = tuple(formats or [("fp32", "fp32")] * cfg.n_layers)
        per_neuron = tuple(neuron_bytes(h, cfg.gated, f, half) for f in formats)
        return cls(attention, kv_pool, lm_head, predictors, per_neuron, formats, h, cfg.gated,
                   half, attention_movable, attention_dtype or torch.float32, extras_movable,
                   host_reads, attention_format)

    @classmethod
    def of_file_blocks(cls, cfg: ModelConfig, weights, n_ctx: int,
                       kv_pool: int, kv_layers=None) -> "ComponentBytes":
        """Every tensor on the tier in the file's own bytes (contract of issue 30): attention
        and norms as stored, the KV pool (`kv_pool` bytes at the KV type's width), the output
        layer, hot FFN neurons as their rows and whole blocks of down (`LayerBytes.hot`);
        `kv_layers`: each layer's share of the pool (see ModelBytes.of_file)."""
        model = ModelBytes.of_file(cfg, weights, n_ctx, kv_pool, kv_layers)
        return cls(sum(l.attention for l in model.layers), kv_pool, model.head, 0,
                   tuple(l.gate_up + l.down for l in model.layers),
                   (("file", "file"),) * cfg.n_layers, cfg.hidden_size, cfg.gated,
                   extras_movable=False, model=model)

    def hot_bytes(self, layer: int, n: int) -> int:
        """Exact tier bytes of n hot neurons in `layer` (what its HotFFNWeights will take)."""
        if self.model is not None:
            return self.model.layers[layer].hot(n)
        if not self.formats:  # sizes made by hand (tests): the per-neuron cost alone
            return n * self.neuron[layer]
        return hot_ffn_bytes(n, self.hidden, self.gated, self.formats[layer], self.half)

    def slack(self, layer: int) -> int:
        """Bytes beyond n * neuron[layer] that hot_bytes may add (int4 padding, int8's
        per-layer row scales): kept free when a solver places neurons by the marginal cost."""
        if not self.formats or self.model is not None:
            return 0
        g = granule(self.formats[layer])
        return max(0, self.hot_bytes(layer, 1) - self.neuron[layer]) + (g - 1) * self.neuron[layer]


def neuron_bytes(hidden: int, gated: bool, formats: tuple[str, str] = ("fp32", "fp32"),
                 half: torch.dtype = torch.bfloat16) -> int:
    """GPU-tier bytes of one more hot neuron (gate if any, up and down) in `formats`: the
    marginal cost over whole groups (exact for fp32: 4 bytes a weight)."""
    g = granule(formats) * 64
    return -(-(hot_ffn_bytes(2 * g, hidden, gated, formats, half)
               - hot_ffn_bytes(g, hidden, gated, formats, half)) // g)


def cold_neuron_bytes(hidden: int, gated: bool, cold_dtype: str) -> int:
    """Host bytes of one cold neuron's bundle (kernels/ffn_bundles.py): its gate (if any), up
    and down rows, int8 with an fp32 scale each or fp32. Derived from the file (its down made
    neuron-major), so charged on top of the mapped file."""
    per_row = hidden + 4 if cold_dtype == "int8" else hidden * FP32
    return (3 if gated else 2) * per_row


def host_ffn_bytes(cfg: ModelConfig, placement: Placement, cold_dtype: str) -> int:
    """Host RAM the cold neurons' bundles take under `placement`."""
    per = cold_neuron_bytes(cfg.hidden_size, cfg.gated, cold_dtype)
    return sum((placement.ffn_sizes[i] - placement.hot_count(i)) * per
               for i in range(placement.n_layers))


def workspace_bytes(cfg: ModelConfig, chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """The tier's working space: activations of one prefill chunk through one layer, and
    what a decoded token's CUDA graph keeps (`decode_graph_bytes`)."""
    width = 2 * cfg.hidden_size + (2 if cfg.gated else 1) * cfg.ffn_size
    width = max(width, cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim)
    return chunk * width * FP32 + decode_graph_bytes(cfg)


_SEGMENT = 2 << 20  # the CUDA caching allocator's segment for blocks under 1 MiB


def decode_graph_bytes(cfg: ModelConfig) -> int:
    """What a decode step's CUDA graph keeps on the tier (offload/body/tier_graph.py), for a
    model's config: `graph_bytes`."""
    return graph_bytes(cfg.n_layers, cfg.hidden_size, cfg.ffn_size, cfg.n_heads * cfg.head_dim,
                       cfg.n_kv_heads * cfg.head_dim, cfg.context_length)


def graph_bytes(n_layers: int, hidden: int, ffn: int, q: int, kv: int, context: int) -> int:
    """A decode step's CUDA graph: its memory pool, one token's float32 activations through
    every layer (q/k/v, attention, o, the residual rows and their norms, gate/up, the
    activation, down) in whole 2 MiB segments (4 MiB for a 1.1B, as measured on an H200),
    and its fixed inputs' slot tables (8 bytes a layer and position of the context)."""
    token = q + 2 * kv + q + 6 * hidden + 3 * ffn
    pool = -(-n_layers * token * FP32 // _SEGMENT) * _SEGMENT
    positions = 1 << max(10, (context - 1).bit_length())
    return pool + n_layers * positions * 8
