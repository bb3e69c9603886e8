"""Llama-2 7B, 13B and 70B as a file of a given quant mix would store them: each tensor's GGML
type and bytes, without the file (what `ember bench placement --shape` forecasts for), and the
host's decode speed as measured on this machine's CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decode_costs import LayerBytes, ModelBytes

QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "F16")
KV_VALUE_BYTES = 2  # float16 K and V, both engines

# `ember bench decode --model <llama2-7b-shaped Q4_K_M> --threads 2 --against llama.cpp`
# on this machine's CPU (AMD EPYC Zen 4, 2 threads; MEASUREMENTS.md, 2026-12-02): tokens/s
MEASURED_7B_TOKENS_PER_S = {"ember": 8.58, "llama.cpp": 7.19}


@dataclass(frozen=True)
class PaperShape:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 32000

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)


SHAPES = {s.name: s for s in (
    PaperShape("llama2-7b", 32, 4096, 11008, 32, 32),
    PaperShape("llama2-13b", 40, 5120, 13824, 40, 40),
    PaperShape("llama2-70b", 80, 8192, 28672, 64, 8),
)}

# (elements, bytes) per block of each GGML type used below
BLOCKS = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q4_0": (32, 18), "Q8_0": (32, 34),
          "F16": (1, 2), "F32": (1, 4)}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's Q4_K_M pick of layers whose attn_v / ffn_down get Q6_K."""
    first, last = n_layers // 8, 7 * n_layers // 8
    return layer < first or layer >= last or (layer - first) % 3 == 2


def tensor_type(quant: str, tensor: str, layer: int, n_layers: int) -> str:
    """GGML type of `tensor` ("attn_q", ..., "ffn_down", "output") in a `quant` file."""
    if quant == "Q4_K_M":
        if tensor == "output" or (tensor in ("attn_v", "ffn_down") and more_bits(layer, n_layers)):
            return "Q6_K"
        return "Q4_K"
    if quant == "Q4_0" and tensor == "output":
        return "Q6_K"
    return quant


def nbytes(qtype: str, elements: int) -> int:
    per, size = BLOCKS[qtype]
    return elements // per * size


def layer_file_bytes(s: PaperShape, quant: str, i: int) -> tuple[int, int]:
    """(attention, FFN) file bytes of layer i, norms included (float32)."""
    h, kv, L = s.hidden, s.kv_dim, s.layers
    attn = sum(nbytes(tensor_type(quant, t, i, L), h * n)
               for t, n in (("attn_q", h), ("attn_k", kv), ("attn_v", kv), ("attn_output", h)))
    ffn = sum(nbytes(tensor_type(quant, t, i, L), h * s.ffn)
              for t in ("ffn_gate", "ffn_up", "ffn_down"))
    return attn + 2 * h * 4, ffn


def head_bytes(s: PaperShape, quant: str) -> int:
    return nbytes(tensor_type(quant, "output", 0, s.layers), s.vocab * s.hidden) + s.hidden * 4


def kv_bytes(s: PaperShape, tokens: int) -> int:
    """K and V of one layer for `tokens` positions."""
    return 2 * s.kv_dim * tokens * KV_VALUE_BYTES


def model_bytes(s: PaperShape, quant: str, ctx: int) -> ModelBytes:
    """The shape's per-layer bytes at a `ctx`-token context."""
    layers = []
    for i in range(s.layers):
        attention, _ = layer_file_bytes(s, quant, i)
        gate_up = 2 * nbytes(tensor_type(quant, "ffn_gate", i, s.layers), s.hidden)
        down_type = tensor_type(quant, "ffn_down", i, s.layers)
        layers.append(LayerBytes(attention, kv_bytes(s, ctx), kv_bytes(s, ctx // 2), gate_up,
                                 nbytes(down_type, s.hidden), s.ffn, BLOCKS[down_type][0]))
    return ModelBytes(tuple(layers), head_bytes(s, quant), s.hidden)


def weights_per_token(s: PaperShape, quant: str) -> int:
    """Weight bytes a token reads: every layer and the output layer."""
    return sum(sum(layer_file_bytes(s, quant, i)) for i in range(s.layers)) + head_bytes(s, quant)


def measured_host_gbps(engine: str) -> float:
    """GB/s the host's decode reached on the 7B-shaped Q4_K_M file (short prompts: the
    weights are nearly all of a token's reads)."""
    return weights_per_token(SHAPES["llama2-7b"], "Q4_K_M") * MEASURED_7B_TOKENS_PER_S[engine] / 1e9
