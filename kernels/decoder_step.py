"""Every decoder layer's forward for T rows in one call, on weights in the file's own blocks.

The rows are a decoded token, a prompt chunk (prefill) or a speculative tree's nodes: each
row reads its own keys from the paged KV pool (`slots[layer][row]`, its own slot last, where
its K/V are written before any row attends; `positions[row]` its position, the last of the
consecutive positions those slots hold), so causal prefill and tree masks are both just
"which slots a row reads". Per layer:

    h = rms_norm(x, attn_norm); q, k, v = h @ [Wq, Wk, Wv]  (one call, one quantization of h)
    (+ q/k/v biases); q/k head norms and rotary; K/V stored; o = attention (kernels.attention); a = o @ Wo
    x, h = residual step (post-attention norm, add, FFN norm)
    f = down(act(h @ Wgate, h @ Wup)); x = x + post-normed f

Projections are `QTensor`s in any type `block_matmul` reads natively. The C++ version
(csrc/decoder_step.cpp) runs the same functions in the same order, so it gives the same bits
as `decoder_step_reference`; every op is row by row, so a row's result does not depend on the
other rows (speculative verification relies on it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ember.models import activations
from ember.models.weights import QTensor

from . import cpu_extension
from .attention import attend
from .block_matmul import block_matmul
from .fused_ops import qk_norm_rope_, residual_norm, rms_norm
from .q8_matmul import q8_0_quantize


class DecoderLayer(NamedTuple):
    """One decoder layer's fixed arguments, as plain tensors and switches (the model's
    reading of them lives in offload/body/file_blocks_model.py). Norm weights are float32 (D,); a
    norm given as None is a step skipped (no q/k head norms, no norm of the attention or FFN
    output before its residual add)."""

    attn_norm: torch.Tensor
    qkv: list[QTensor]  # q, k, v projections (out, hidden): outputs side by side
    n_heads: int
    n_kv: int
    head_dim: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    interleaved: bool  # rotary pairs (x0, x1), ... rather than halves
    wo: QTensor
    post_attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    gate_up: list[QTensor]  # [gate, up] for gated activations, [up] otherwise
    down: QTensor
    activation: str
    post_ffn_norm: torch.Tensor | None
    eps: float
    scale: float  # attention scale
    qkv_bias: torch.Tensor | None = None  # (q + 2 kv columns,) added to the projections
    attn_softcap: float = 0.0  # > 0: scaled scores s become cap * tanh(s / cap)


def _file_matmul(slot: str, x: torch.Tensor, weights: list[QTensor]) -> torch.Tensor:
    return block_matmul(x, weights)


def bf16_flushed(values: torch.Tensor) -> torch.Tensor:
    """float32 values as a bfloat16 pool stores them: rounded to nearest even, subnormals as
    signed zeros (AVX512_BF16's dot products read them as zeros; csrc/attention_math.h)."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(values.abs() < tiny, values * 0, values).bfloat16()


# A reference pass's matmuls go through matmul(slot, x, weights), slot one of "qkv", "o",
# "gate_up", "down": a caller can watch or change one matmul's input (input thresholds'
# calibration and their masked reference, offload/body/input_sparsity.py).
def _store(pool: torch.Tensor, slot: int, values: torch.Tensor) -> None:
    """One position's K or V (n_kv, hd) into a pool row in the pool's type (a uint8 pool
    holds Q8_0 blocks: the bytes csrc/attention.cpp's store_row writes)."""
    if pool.dtype == torch.uint8:
        pool[slot] = q8_0_quantize(values)
    elif pool.dtype == torch.bfloat16:
        pool[slot] = bf16_flushed(values)
    else:
        pool[slot] = values


def attention_reference(layer: DecoderLayer, x, k_pool, v_pool, read_slots, positions, cos,
                        sin, matmul=_file_matmul):
    """The attention sub-layer for T rows: (x + post-normed attention, FFN-normed input)."""
    L = layer
    qkv = matmul("qkv", rms_norm(x, L.attn_norm, L.eps), L.qkv)
    if L.qkv_bias is not None:
        qkv.add_(L.qkv_bias)
    qk_norm_rope_(qkv, L.n_heads, L.n_kv, L.head_dim, L.q_norm, L.k_norm, cos, sin,
                  L.interleaved, L.eps)
    q_cols, kv_cols = L.n_heads * L.head_dim, L.n_kv * L.head_dim
    q, k, v = qkv.split((q_cols, kv_cols, kv_cols), dim=1)
    for t, slots in enumerate(read_slots):  # every row's K/V first: tree rows read ancestors'
        _store(k_pool, int(slots[-1]), k[t].view(L.n_kv, L.head_dim))
        _store(v_pool, int(slots[-1]), v[t].view(L.n_kv, L.head_dim))
    o = attend(q.view(-1, L.n_heads, L.head_dim), k_pool, v_pool, read_slots, positions,
               L.scale, L.attn_softcap)
    return residual_norm(x, matmul("o", o, [L.wo]).contiguous(), L.post_attn_norm,
                         L.ffn_norm, L.eps)


def ffn_reference(layer: DecoderLayer, x, h, matmul=_file_matmul):
    """The FFN sub-layer for T rows and its residual step: x + post-normed FFN(h)."""
    L = layer
    gu = matmul("gate_up", h, L.gate_up)
    if activations.is_gated(L.activation):
        n = L.down.shape[1]
        gate, up = gu[:, :n], gu[:, n:]
    else:
        gate, up = None, gu
    f = matmul("down", activations.activate(L.activation, gate, up).contiguous(), [L.down])
    return residual_norm(x, f.contiguous(), L.post_ffn_norm, None, L.eps)[0]


def decoder_step_reference(layers: list[DecoderLayer], x, k_pool, v_pool, slots, positions,
                           cos, sin, matmul=None):
    """Every layer for T rows x (T, hidden): slots[i][t] are the pool rows row t reads in
    layer i (its own last), positions (T,) int64 the rows' positions; cos[i], sin[i] the
    rows' rotary tables (T, head_dim / 2).
    `matmul(i, slot, x, weights)`, when given, computes layer i's matmuls."""
    for i, (layer, read_slots, c, s) in enumerate(zip(layers, slots, cos, sin, strict=True)):
        mm = _file_matmul if matmul is None else functools.partial(matmul, i)
        mid, h = attention_reference(layer, x, k_pool, v_pool, read_slots, positions, c, s, mm)
        x = ffn_reference(layer, mid, h, mm)
    return x


def _native_layer(layer: DecoderLayer) -> tuple:
    """A layer's arguments as the C++ DecoderStep takes them: each weight as its
    (rows, row_bytes) bytes and its GGML type."""
    def weights(ts):
        return [t.rows() for t in ts], [t.qtype for t in ts]

    qkv, qkv_types = weights(layer.qkv)
    gate_up, gate_up_types = weights(layer.gate_up)
    return (layer.attn_norm, qkv, qkv_types, layer.n_heads, layer.n_kv, layer.head_dim,
            layer.q_norm, layer.k_norm, layer.interleaved, layer.wo.rows(), layer.wo.qtype,
            layer.post_attn_norm, layer.ffn_norm, gate_up, gate_up_types, layer.down.rows(),
            layer.down.qtype, activations.code(layer.activation), layer.post_ffn_norm, layer.eps,
            layer.scale,
            layer.qkv_bias, layer.attn_softcap)


def available() -> bool:
    module = cpu_extension.load()
    return module is not None and hasattr(module, "DecoderStep")


def layer_attention(layers: list[DecoderLayer]):
    """A function (i, x, k_pool, v_pool, read_slots, positions, cos, sin) -> (x + attention, the FFN's
    normed input) running layer i's attention sub-layer alone, for a runtime that computes
    each FFN itself (the hybrid split); the same bits as that layer's part of a full pass."""
    module = cpu_extension.load()
    if module is None or not hasattr(module, "DecoderStep"):
        return lambda i, *args: attention_reference(layers[i], *args)
    native = module.DecoderStep()
    for layer in layers:
        native.add_layer(*_native_layer(layer))
    return native.run_attention


def decoder_step(layers: list[DecoderLayer]):
    """A function (x, k_pool, v_pool, slots, positions, cos, sin) -> x running every layer over T rows
    in one C++ call (see `decoder_step_reference`, which it matches bit for bit)."""
    module = cpu_extension.load()
    if module is None or not hasattr(module, "DecoderStep"):
        return functools.partial(decoder_step_reference, list(layers))
    native = module.DecoderStep()
    for layer in layers:
        native.add_layer(*_native_layer(layer))
    return native.run
