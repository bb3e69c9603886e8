"""Fused row-wise ops for the CPU decode step (C++ in csrc/: fused_ops.cpp, select.cpp), each `op` beside its plain PyTorch `op_reference`.

At batch 1 a decode step's small ops cost their dispatch, not their arithmetic: an rms_norm is
seven PyTorch ops, and the default model runs six norms per layer. These do each chain in one
call. Model-agnostic: they take tensors and switches (a norm or None, interleaved or not), and
the caller (offload/body/) decides from its model what to pass. The references use the same
PyTorch ops in the same order as the reference model's (models/transformer.py, rotary.py), and
tests/test_kernel_convention.py checks they give its bits, so the fused path is checked
against exactly what the reference model computes.

Every op is row by row: a row's result does not depend on the other rows (bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.models.rotary import rotate as rotate_reference  # plain math: the model's own

from . import cpu_extension


def available() -> bool:
    module = cpu_extension.load()
    return module is not None and hasattr(module, "qk_norm_rope_")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In place on the (T, 1) statistic: two fewer allocations per call, same values.
    return x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_() * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, D) / rms(x) * weight, per row."""
    module = cpu_extension.load()
    if module is None:
        return rms_norm_reference(x, weight, eps)
    return module.rms_norm(x, weight, eps)


def residual_norm_reference(x, a, post, nxt, eps):
    x = x + (rms_norm_reference(a, post, eps) if post is not None else a)
    return x, (rms_norm_reference(x, nxt, eps) if nxt is not None else x)


def residual_norm(x: torch.Tensor, a: torch.Tensor, post: torch.Tensor | None,
                  nxt: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's residual step: x' = x + (rms_norm(a, post) if post else a), and the next
    sub-layer's input rms_norm(x', nxt) (x' itself when nxt is None). Returns (x', input)."""
    module = cpu_extension.load()
    if module is None:
        return residual_norm_reference(x, a, post, nxt, eps)
    return module.residual_norm(x, a, post, nxt, eps)


def qk_norm_rope_reference(qkv, n_heads, n_kv, head_dim, q_norm, k_norm, cos, sin,
                           interleaved, eps) -> None:
    t = qkv.shape[0]
    q_out = qkv[:, :n_heads * head_dim].view(t, n_heads, head_dim)
    k_out = qkv[:, n_heads * head_dim:(n_heads + n_kv) * head_dim].view(t, n_kv, head_dim)
    q, k = q_out, k_out
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    c, s = cos[:, None, :], sin[:, None, :]
    q_out.copy_(rotate_reference(q, c, s, interleaved))
    k_out.copy_(rotate_reference(k, c, s, interleaved))


def qk_norm_rope_(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, eps: float) -> None:
    """In place on a fused projection's output qkv (T, (n_heads + 2 n_kv) * head_dim): the q
    and k heads are rms-normed (when norms are given) and rotated by cos/sin (T, head_dim/2).
    The v columns are left alone."""
    module = cpu_extension.load()
    if module is None:
        qk_norm_rope_reference(qkv, n_heads, n_kv, head_dim, q_norm, k_norm, cos, sin,
                               interleaved, eps)
        return
    module.qk_norm_rope_(qkv, n_heads, n_kv, head_dim, q_norm, k_norm, cos.contiguous(),
                         sin.contiguous(), interleaved, eps)


def attend_slots_reference(q, k_pool, v_pool, slots, scale, softcap: float = 0.0) -> torch.Tensor:
    """Pools of float32 or float16 (FileBlocksModel's, on the file's quant blocks), in float32: the
    gathered keys through PyTorch's attention (grouped K/V heads, no mask: one query sees
    every key it is given), or written out when scores are soft-capped."""
    keys, values = k_pool.index_select(0, slots).float(), v_pool.index_select(0, slots).float()
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


def attend_slots(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slots: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One query row q (n_heads, hd) against the pool rows `slots` of k_pool/v_pool
    (rows, n_kv_heads, hd; float32 or float16), read in place: (1, n_heads * hd).
    softcap > 0: scores soft-capped first (Gemma 2)."""
    module = cpu_extension.load()
    if module is None:
        return attend_slots_reference(q, k_pool, v_pool, slots, scale, softcap)
    return module.attend_slots(q.contiguous(), k_pool, v_pool, slots, scale, softcap)


def argmax_reference(v: torch.Tensor) -> int:
    return int(torch.argmax(v))


def argmax(v: torch.Tensor) -> int:
    """`argmax_reference` (torch.argmax: first index on ties, NaN counts as largest) of a
    float32 vector, faster."""
    module = cpu_extension.load()
    if module is None or v.dtype != torch.float32 or v.device.type != "cpu" or v.dim() != 1:
        return argmax_reference(v)
    return module.argmax(v.contiguous())


# Above this k the insertion-sorted list costs more than torch.topk's selection, which then
# does the work (ties in its own order).
TOP_K_NATIVE_MAX = 1024


def top_k_reference(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of a vector: largest first, ties to the lower index,
    NaN above any number (a stable descending sort)."""
    order = torch.sort(v, descending=True, stable=True).indices[:k]
    return v[order], order


def top_k(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_reference` in one pass over the vector (sampling's candidates from 262k logits:
    torch.topk took ~0.8 ms, this ~0.06-0.1 ms); torch.topk for a large k or without the
    C++ kernels."""
    module = cpu_extension.load()
    if (module is None or k > TOP_K_NATIVE_MAX or v.dtype != torch.float32
            or v.device.type != "cpu" or v.dim() != 1):
        values, ids = torch.topk(v, k)  # (a stable full sort took ~29 ms for k=2000 here)
        return values, ids
    return module.top_k(v.contiguous(), k)
