"""Attention of T query rows over keys and values read in place from a paged KV pool (C++:
csrc/attention.cpp), beside its plain PyTorch reference.

Row t reads the pool rows `slots[t]` (position order, its own last), which hold positions
positions[t] - len(slots[t]) + 1 .. positions[t]: a decoded token, the rows of a prompt chunk
(each seeing the keys up to itself, in its window) or a speculative tree's rows (context, then
ancestors). The kernel is flash attention tiled over rows and position-aligned key chunks
(the positions only align the chunks; they change no value), so each chunk of K/V is read once
for a tile of rows and for every query head that shares its KV head. A row's bits depend
only on its own query and keys: alone, in a chunk or in a tree, on any thread count and CPU
path (attention_math.h says the arithmetic, tests/test_attention.py checks it against float64).

Pools (rows, n_kv_heads, ...) are float32, float16 (the file-blocks runtime's default, as
llama.cpp's f16 cache), uint8 Q8_0 blocks (`--kv-type q8_0`: 32 values in 34 bytes, an
fp16 scale and 32 int8, as GGML's Q8_0; `q8_0_rows`) or bfloat16 (`--kv-type bf16`: its
scores and weights computed as AVX512_BF16's dot products compute them, natively where the CPU
has them; csrc/attention_math.h).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ember.models import quants
from ember.models.support.errors import ConfigError

from . import cpu_extension

Q8_0_VALUES, Q8_0_BYTES = 32, 34  # per block


def available() -> bool:
    module = cpu_extension.load()
    return module is not None and hasattr(module, "attend")


def kv_row_values(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of `dtype` one KV head's head_dim values take in a pool row: head_dim, or the
    bytes of its Q8_0 blocks for a uint8 pool (ConfigError unless whole blocks; a bfloat16
    pool's dot products also take 32 values at a time)."""
    names = {torch.uint8: "--kv-type q8_0", torch.bfloat16: "--kv-type bf16"}
    if dtype in names and head_dim % Q8_0_VALUES:
        raise ConfigError(f"{names[dtype]} needs a head dim that is a multiple of "
                          f"{Q8_0_VALUES}; this model's is {head_dim}: use --kv-type f16",
                          setting="kv_type")
    if dtype != torch.uint8:
        return head_dim
    return head_dim // Q8_0_VALUES * Q8_0_BYTES


def pool_values(rows: torch.Tensor) -> torch.Tensor:
    """Pool rows (S, n_kv, ...) as the float32 values they hold (Q8_0 blocks decoded)."""
    if rows.dtype != torch.uint8:
        return rows.float()
    s, n_kv, nbytes = rows.shape
    hd = nbytes // Q8_0_BYTES * Q8_0_VALUES
    return quants.dequantize(rows.reshape(-1), int(Q.Q8_0), (s, n_kv, hd))


def _attend_row(q, keys, values, scale: float, softcap: float) -> torch.Tensor:
    """q (n_heads, hd) over keys/values (S, n_kv, hd) float32: (1, n_heads * hd), through
    PyTorch's attention (grouped K/V heads, no mask), or written out when soft-capped."""
    n_heads, hd = q.shape
    if softcap:
        group = n_heads // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_heads, S, hd)
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[None].transpose(0, 1) @ k.transpose(1, 2) * scale  # (n_heads, 1, S)
        scores = torch.tanh(scores / softcap) * softcap
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(1, n_heads * hd)
    out = F.scaled_dot_product_attention(
        q[None].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=None, scale=scale, enable_gqa=True)  # (1, n_heads, 1, hd)
    return out[0].transpose(0, 1).reshape(1, n_heads * hd)


def attend_reference(q, k_pool, v_pool, slots, positions, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """Row by row: the gathered keys' float32 values through PyTorch's attention (over a
    bfloat16 pool, the queries rounded to bfloat16 as the kernel's dot products take them)."""
    del positions  # they align the kernel's chunks; the values do not depend on them
    if k_pool.dtype == torch.bfloat16:
        q = q.bfloat16().float()
    return torch.cat([_attend_row(q[t], pool_values(k_pool.index_select(0, s)),
                                  pool_values(v_pool.index_select(0, s)), scale, softcap)
                      for t, s in enumerate(slots)])


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           slots: list[torch.Tensor], positions: torch.Tensor, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """q (T, n_heads, hd) over the pool rows `slots[t]` of k_pool/v_pool (rows, n_kv, ...;
    float32, float16 or Q8_0), row t at `positions[t]`: (T, n_heads * hd). softcap > 0:
    scores soft-capped first (Gemma 2)."""
    module = cpu_extension.load()
    if module is None:
        return attend_reference(q, k_pool, v_pool, slots, positions, scale, softcap)
    t, n_heads, hd = q.shape
    return module.attend(q.reshape(t, n_heads * hd).contiguous(), k_pool, v_pool, list(slots),
                         positions, n_heads, scale, softcap)
