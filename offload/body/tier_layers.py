"""Copies of the file's layers for the GPU tier, in a tier format, and what they take there.

Per layer, attention's q/k/v/o as one `TierAttentionWeights` (kernels/tier_attention.py):
in the file's own blocks (format "file": `TierBlocks`, the file's bytes and values), or made
once from the file's values as int8/int4 codes or bf16/fp16/fp32 (`TierLinear`, their
conversion error measured). The LM head likewise (`TierLMHead`). `tier_attention_bytes` and
`tier_head_bytes` are what the memory plan charges for them, to the byte.
"""

from __future__ import annotations

import torch

from ember.kernels.tier_attention import TierAttentionWeights, attention_bytes
from ember.kernels.tier_blocks import TierBlocks
from ember.kernels.tier_weights import TierLinear, int4_fits, linear_bytes
from ember.models.transformer import softcap

from .file_layers import FileLayers

FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_ROWS = 16384  # LM head rows converted at a time (a float32 copy of them is made)


def matrix_format(fmt: str, n_out: int, n_in: int) -> str:
    """`fmt` for an (n_out, n_in) matrix, int4 becoming int8 where its tiles cannot take it."""
    return "int8" if fmt == "int4" and not int4_fits(n_out, n_in) else fmt


def _vectors(file: FileLayers) -> int:
    """Values of one layer's norms and bias (what `TierAttentionWeights.norms` holds)."""
    cfg, hd = file.cfg, file.cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return attention_bytes(cfg.hidden_size, q, kv, hd, torch.float32, cfg.qkv_bias,
                           cfg.qk_norm, cfg.sandwich_norms) // 4 - (q + 2 * kv + q) * cfg.hidden_size


def attention_layer_bytes(file: FileLayers, fmt: str,
                          half: torch.dtype = torch.bfloat16) -> list[int]:
    """Per layer, the exact tier bytes of its attention in `fmt` (what the built copy takes:
    `TierAttentionWeights.nbytes`); a plan placing layers one by one prices them with this."""
    cfg, hd, h = file.cfg, file.cfg.head_dim, file.cfg.hidden_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out = []
    for layer in file.layers:
        if fmt in FLOATS:
            out.append(attention_bytes(h, q, kv, hd, FLOATS[fmt], cfg.qkv_bias, cfg.qk_norm,
                                       cfg.sandwich_norms))
            continue
        if fmt == "file":
            weights = sum(t.nbytes for t in (*layer.qkv, layer.wo))
        else:
            weights = (linear_bytes(matrix_format(fmt, q + 2 * kv, h), q + 2 * kv, h, half)
                       + linear_bytes(matrix_format(fmt, h, q), h, q, half))
        out.append(weights + _vectors(file) * 4)  # norms and bias in float32
    return out


def tier_attention_bytes(file: FileLayers, fmt: str, half: torch.dtype = torch.bfloat16) -> int:
    """Exact tier bytes of every layer's attention in `fmt` (what the built copies take)."""
    return sum(attention_layer_bytes(file, fmt, half))


def tier_attention_weights(file: FileLayers, i: int, device: torch.device, fmt: str,
                           half: torch.dtype = torch.bfloat16) -> TierAttentionWeights:
    """Layer i's attention weights and norms on `device` in `fmt`: the file's blocks as they
    are, or made once from the file's values (their conversion error measured)."""
    L, p = file.layers[i], f"blk.{i}."
    norms = {"attn_norm": L.attn_norm, "ffn_norm": L.ffn_norm, "qkv_bias": L.qkv_bias,
             "post_attn_norm": L.post_attn_norm, "post_ffn_norm": L.post_ffn_norm,
             "q_norm": L.q_norm, "k_norm": L.k_norm}
    switches = (L.n_heads, L.n_kv, L.head_dim, L.interleaved, L.eps, L.scale, L.attn_softcap)
    if fmt == "file":
        return TierAttentionWeights.of(TierBlocks.of(L.qkv, device, half),
                                       TierBlocks.of([L.wo], device, half), norms, *switches)

    def values(name: str, t) -> torch.Tensor:  # the file's own values
        return file.weights.load(p + name, tuple(t.shape))

    qkv = torch.cat([values(f"attn_{n}.weight", t) for n, t in zip("qkv", L.qkv)])
    o = values("attn_output.weight", L.wo)
    if fmt in FLOATS:
        return TierAttentionWeights.pack(qkv, o, norms, *switches, device, FLOATS[fmt])
    return TierAttentionWeights.of(
        TierLinear.pack(qkv, matrix_format(fmt, *qkv.shape), device, half),
        TierLinear.pack(o, matrix_format(fmt, *o.shape), device, half), norms, *switches)


def tier_head_bytes(file: FileLayers, fmt: str, half: torch.dtype = torch.bfloat16) -> int:
    """Exact tier bytes of the LM head in `fmt` (`tier_head`'s tensors)."""
    n, k = file.head.shape
    if fmt == "file":
        return file.head.nbytes
    if fmt in FLOATS:
        return n * k * FLOATS[fmt].itemsize
    return sum(linear_bytes(matrix_format(fmt, min(HEAD_ROWS, n - r), k),
                            min(HEAD_ROWS, n - r), k, half) for r in range(0, n, HEAD_ROWS))


class TierLMHead:
    """hidden (T, H) on the host -> logits (T, vocab) on the host, computed on the tier from
    the head matrix in a tier format (row chunks of at most HEAD_ROWS, side by side)."""

    batch_invariant = False  # a float matmul's rounding may depend on T

    def __init__(self, chunks: list, cap: float | None, stored):
        self.chunks, self.cap = chunks, cap
        self.stored = stored  # the file's head, for a drafter's shortlist rows
        self.device = chunks[0].device

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float().to(self.device)
        logits = torch.cat([m(x).float() for m in self.chunks], dim=1)
        return softcap(logits, self.cap).cpu()

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.chunks)


def tier_head(file: FileLayers, device: torch.device, fmt: str,
              half: torch.dtype = torch.bfloat16) -> TierLMHead:
    """The LM head on `device` in `fmt` (the file's blocks as they are, or made from the
    file's values a chunk of rows at a time)."""
    cap, head = file.cfg.final_logit_softcap, file.head
    if fmt == "file":
        return TierLMHead([TierBlocks.of([head], device, half)], cap, head)
    n, k = head.shape
    chunks = []
    for r in range(0, n, HEAD_ROWS):
        rows = head.row_slice(r, min(n, r + HEAD_ROWS)).dequantize()
        chunks.append(TierLinear.pack(rows, matrix_format(fmt, *rows.shape), device, half))
    return TierLMHead(chunks, cap, head)
