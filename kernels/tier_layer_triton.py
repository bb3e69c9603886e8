"""A GPU-tier layer's steps around its matrices as one Triton kernel each: the RMS norm, the
residual step with the next norm, the q/k head norms with the rotary embedding, the rows' K/V
stored in the paged pool, and the attention of a token (or a draft tree's rows) over it.

Why: written as torch ops (kernels/fused_ops.py's references) these steps launched most of
a tier layer's ~56 kernels per decoded token on an H200, and a decode step there was bound by
launches, not by the GPU; and attention copied every key and value it read to float32 first
(two gathers and two conversions a layer). Each kernel here is one launch per call, one
program per row (and head), so a row's result does not depend on the rows beside it (batch
invariance, as the references); attention reads the pool's own rows in their own type. They
compute what the references compute in float32; sums are reduced in another order, so results
agree to rounding, not bit for bit (tests/test_tier_layer_triton.py). The K/V store rounds as
torch does, bit for bit. kernels/triton_support.py says where they run.
"""

from __future__ import annotations

import torch

from . import triton_support

tl = None  # triton.language, bound by triton_support when a kernel is first compiled
bf16_bits = None  # triton_support.bf16_bits, as the kernels call it (bound with tl)


def available() -> bool:
    """Whether these kernels can run here: Triton installed (a CUDA device, or the interpreter, is
    `triton_support.usable`'s question)."""
    return triton_support.available()


def _block(n: int) -> int:
    """The power of two a program's vector spans for n values."""
    return 1 << max(0, (n - 1).bit_length())


def self_check(device: torch.device) -> bool:
    """Each kernel on `device` against its plain reference on small inputs (once, through
    triton_support.checked, before a tier layer uses them)."""
    from .attention import attend_reference
    from .fused_ops import (qk_norm_rope_reference, residual_norm_reference,
                            rms_norm_reference)

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def close(got, want) -> bool:
        return torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-4)

    x, a, w, w2 = rand(3, 96), rand(3, 96), rand(96), rand(96)
    ok = close(rms_norm(x.to(device), w.to(device), 1e-6), rms_norm_reference(x, w, 1e-6))
    got = residual_norm(x.to(device), a.to(device), w.to(device), w2.to(device), 1e-6)
    want = residual_norm_reference(x, a, w, w2, 1e-6)
    ok = ok and close(got[0], want[0]) and close(got[1], want[1])
    n_heads, n_kv, hd = 4, 2, 64
    qkv, angle, qn, kn = rand(3, (n_heads + 2 * n_kv) * hd), rand(3, hd // 2), rand(hd), rand(hd)
    want = qkv.clone()
    qk_norm_rope_reference(want, n_heads, n_kv, hd, qn, kn, angle.cos(), angle.sin(), False,
                           1e-6)
    got = qkv.to(device)
    qk_norm_rope_(got, n_heads, n_kv, hd, qn.to(device), kn.to(device), angle.cos().to(device),
                  angle.sin().to(device), False, 1e-6)
    ok = ok and close(got, want)
    # the stores and attention from the kernels' own q/k/v, on the device (`got`)
    pools = [torch.zeros(8, n_kv, hd, dtype=torch.float16, device=device) for _ in "kv"]
    own = torch.tensor([5, 2, 7])
    store_kv(got, n_heads, n_kv, hd, *pools, own.to(device))
    qkv = got.cpu()
    k = qkv[:, n_heads * hd:(n_heads + n_kv) * hd].reshape(3, n_kv, hd).half()
    ok = ok and torch.equal(pools[0].cpu()[own], k)
    q = qkv[:, :n_heads * hd].reshape(3, n_heads, hd)
    keys, mask = torch.tensor([2, 5, 7]), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]) > 0
    out = attend(q.to(device), *pools, keys.to(device), mask.to(device), hd ** -0.5, 0.0)
    return ok and close(out, attend_reference(q, pools[0].cpu(), pools[1].cpu(),
                                              [keys[m] for m in mask], None, hd ** -0.5))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, D) / rms(x) * weight, per row: float32 (T, D)."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    t, d = x.shape
    _RESIDUAL_NORM[(t,)](x, x, weight, weight, y, y, d, eps, HAS_A=False, HAS_POST=False,
                         HAS_NEXT=True, BLOCK=_block(d))
    return y


def residual_norm(x: torch.Tensor, a: torch.Tensor, post: torch.Tensor | None,
                  nxt: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x' = x + (rms_norm(a, post) if post else a) and rms_norm(x', nxt) (x' itself when nxt
    is None), per row: (x', the next input), float32."""
    x, a = x.float().contiguous(), a.float().contiguous()
    t, d = x.shape
    out = torch.empty_like(x)
    nxt_out = torch.empty_like(x) if nxt is not None else out
    _RESIDUAL_NORM[(t,)](x, a, post if post is not None else x, nxt if nxt is not None else x,
                         out, nxt_out, d, eps, HAS_A=True, HAS_POST=post is not None,
                         HAS_NEXT=nxt is not None, BLOCK=_block(d))
    return out, nxt_out


def qk_norm_rope_(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor, interleaved: bool, eps: float) -> None:
    """In place on qkv (T, (n_heads + 2 n_kv) head_dim) float32, contiguous: the q and k heads
    rms-normed (when norms are given) and rotated by cos/sin (T, head_dim / 2); v left alone."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError("qkv must be contiguous float32")
    t = qkv.shape[0]
    half = head_dim // 2
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    norm = q_norm is not None
    _QK_NORM_ROPE[(t, n_heads + n_kv)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, qkv.shape[1], n_heads,
        head_dim, half, eps, HAS_NORM=norm, INTERLEAVED=interleaved, BLOCK=_block(half))


def store_kv(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, k_pool: torch.Tensor,
             v_pool: torch.Tensor, own: torch.Tensor) -> None:
    """The k and v columns of qkv (T, (n_heads + 2 n_kv) head_dim) float32, contiguous,
    written at pool rows `own` (T,) of the pools (rows, n_kv, head_dim), rounded to their
    type to nearest even (as torch's conversion)."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError("qkv must be contiguous float32")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the pools must be contiguous")
    t = qkv.shape[0]
    bf16 = k_pool.dtype == torch.bfloat16  # rounded by hand: as torch rounds, on any backend
    if bf16:
        k_pool, v_pool = k_pool.view(torch.int16), v_pool.view(torch.int16)
    _STORE_KV[(t, n_kv)](qkv, k_pool, v_pool, own.contiguous(), qkv.shape[1], n_heads, n_kv,
                         head_dim, BF16=bf16, BLOCK=_block(head_dim))


ATTEND_ROWS = 32  # rows attended here at most (a token, a draft tree); a prompt takes SDPA
_KEYS_PER_STEP = 32  # keys a program scores at a time
# Programs a row and head's keys are split over, each with its share of whole steps, their
# partial softmaxes merged after: a long context's keys read by many programs at once (one
# program a head read them all before: 199 tok/s on the H200 after 1k tokens, 441 after 64).
# Fixed, not by T: a row's sums are grouped by its keys alone (batch invariance).
ATTEND_SPLITS = 16


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, keys: torch.Tensor,
           mask: torch.Tensor | None, scale: float, softcap: float,
           span: torch.Tensor | None = None) -> torch.Tensor:
    """Row t of q (T, n_heads, hd) float32 attends to the pool rows `keys` (S,) it may see
    (mask (T, S) bool, None: all): softmax(q k^T scale, tanh-capped at `softcap` when set) v,
    read from the pools (rows, n_kv, hd) in their own type, with a one-pass online softmax
    over each of ATTEND_SPLITS stretches of the keys, then their merge: (T, n_heads * hd)
    float32. T <= ATTEND_ROWS.

    span (2,) int64 on the device, with no mask: only keys[span[0]:span[0] + span[1]] are
    read, their count read by the kernels themselves (a CUDA graph replays one launch for
    every length; offload/body/tier_graph.py)."""
    t, n_heads, hd = q.shape
    n_kv = k_pool.shape[1]
    if not 0 < t <= ATTEND_ROWS:
        raise ValueError(f"{t} rows: this kernel attends 1..{ATTEND_ROWS}")
    if span is not None and (mask is not None or span.shape != (2,)
                             or span.dtype != torch.int64):
        raise ValueError("a span is (first key, keys) int64, without a mask")
    if n_heads % n_kv or k_pool.shape != v_pool.shape or k_pool.shape[2] != hd:
        raise ValueError("pools must be (rows, n_kv, head_dim) with n_heads a multiple of n_kv")
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != hd:
        q = q.float().contiguous()  # rows of heads, each contiguous (a view of qkv is)
    # per row, head and stretch: its weighted values (hd), its top score, its total weight
    parts = torch.empty(t, n_heads, ATTEND_SPLITS, hd + 2, dtype=torch.float32,
                        device=q.device)
    out = torch.empty(t, n_heads * hd, dtype=torch.float32, device=q.device)
    s = keys.shape[0]
    has_mask = mask is not None
    mask = mask.to(torch.int8).contiguous() if has_mask else keys
    _ATTEND[(t, n_heads, ATTEND_SPLITS)](
        q, q.stride(0), k_pool.contiguous(), v_pool.contiguous(), keys.contiguous(), mask,
        keys if span is None else span, parts, s, n_heads, n_kv, hd, float(scale),
        float(softcap), HAS_MASK=has_mask, SPAN=span is not None, SOFTCAP=bool(softcap),
        SPLITS=ATTEND_SPLITS, BLOCK_S=_KEYS_PER_STEP, BLOCK_D=_block(hd))
    _ATTEND_MERGE[(t, n_heads)](parts, out, hd, SPLITS=ATTEND_SPLITS, BLOCK_D=_block(hd))
    return out


def _attend_source(q_ptr, q_stride, k_ptr, v_ptr, keys_ptr, mask_ptr, span_ptr, parts_ptr, S,
                   NH, NKV, HD, scale, softcap, HAS_MASK: tl.constexpr, SPAN: tl.constexpr,
                   SOFTCAP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    # program (t, h, j): query head h of row t against stretch j of its KV head's keys,
    # BLOCK_S at a time; a stretch is a whole number of steps, the last ones may be empty
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    row_s = S  # a mask row's length: every key of the table
    if SPAN:  # the keys' first index and count, from the device
        keys_ptr += tl.load(span_ptr)
        S = tl.load(span_ptr + 1).to(tl.int32)
    per = tl.cdiv(tl.cdiv(S, SPLITS), BLOCK_S) * BLOCK_S
    first = j * per
    end = tl.minimum(first + per, S)
    kv_head = h // (NH // NKV)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HD
    q = tl.load(q_ptr + t * q_stride + h * HD + d, mask=d_in, other=0.0)
    top = tl.full((), -3.0e38, tl.float32)  # the running maximum score (finite: no NaN)
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s0 in range(first, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        seen = s < end
        if HAS_MASK:
            seen = seen & (tl.load(mask_ptr + t * row_s + s, mask=seen, other=0) != 0)
        slot = tl.load(keys_ptr + s, mask=seen, other=0).to(tl.int64)
        at = (slot * NKV + kv_head)[:, None] * HD + d[None, :]
        both = seen[:, None] & d_in[None, :]
        k = tl.load(k_ptr + at, mask=both, other=0.0).to(tl.float32)
        score = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP:  # softcap * tanh(score / softcap), tanh written with exp
            score = softcap * (1.0 - 2.0 / (tl.exp(2.0 * score / softcap) + 1.0))
        score = tl.where(seen, score, -3.0e38)
        new_top = tl.maximum(top, tl.max(score, axis=0))
        p = tl.where(seen, tl.exp(score - new_top), 0.0)
        shrink = tl.exp(top - new_top)
        v = tl.load(v_ptr + at, mask=both, other=0.0).to(tl.float32)
        total = total * shrink + tl.sum(p, axis=0)
        acc = acc * shrink + tl.sum(p[:, None] * v, axis=0)
        top = new_top
    part = parts_ptr + ((t * NH + h) * SPLITS + j).to(tl.int64) * (HD + 2)
    tl.store(part + d, acc, mask=d_in)
    tl.store(part + HD, top)
    tl.store(part + HD + 1, total)


def _attend_merge_source(parts_ptr, out_ptr, HD, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (t, h): the stretches' partial softmaxes rescaled to their common maximum and
    # summed (an empty stretch has weight 0: its top is -3e38)
    t = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    j = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HD
    part = parts_ptr + ((t * nh + h) * SPLITS + j).to(tl.int64) * (HD + 2)
    tops = tl.load(part + HD)
    weight = tl.exp(tops - tl.max(tops, axis=0))
    total = tl.sum(tl.load(part + HD + 1) * weight, axis=0)
    acc = tl.load(part[:, None] + d[None, :], mask=d_in[None, :], other=0.0)
    acc = tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + (t * nh + h) * HD + d, acc / total, mask=d_in)


def _store_kv_source(qkv_ptr, k_ptr, v_ptr, own_ptr, row_len, NH, NKV, HD, BF16: tl.constexpr,
                     BLOCK: tl.constexpr):
    # program (t, j): K head j and V head j of row t, to the row's pool slot (BF16: the pools
    # are int16 views taking the bfloat16 bits)
    t = tl.program_id(0)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    inside = d < HD
    src = qkv_ptr + t.to(tl.int64) * row_len + (NH + j) * HD + d
    dst = (tl.load(own_ptr + t).to(tl.int64) * NKV + j) * HD + d
    k = tl.load(src, mask=inside, other=0.0)
    v = tl.load(src + NKV * HD, mask=inside, other=0.0)
    if BF16:
        k, v = bf16_bits(k), bf16_bits(v)
    tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=inside)
    tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=inside)


def _residual_norm_source(x_ptr, a_ptr, post_ptr, nxt_ptr, out_ptr, nxt_out_ptr, D, eps,
                          HAS_A: tl.constexpr, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
                          BLOCK: tl.constexpr):
    # one program per row; without A it is the plain norm of x (into nxt_out)
    row = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK)
    inside = d < D
    x = tl.load(x_ptr + row + d, mask=inside, other=0.0)
    if HAS_A:
        a = tl.load(a_ptr + row + d, mask=inside, other=0.0)
        if HAS_POST:
            w = tl.load(post_ptr + d, mask=inside, other=0.0).to(tl.float32)
            a = a * tl.rsqrt(tl.sum(a * a, axis=0) / D + eps) * w
        x = x + a
        tl.store(out_ptr + row + d, x, mask=inside)
    if HAS_NEXT:
        w = tl.load(nxt_ptr + d, mask=inside, other=0.0).to(tl.float32)
        tl.store(nxt_out_ptr + row + d, x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w,
                 mask=inside)


def _qk_norm_rope_source(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, row_len, NH, HD, HALF, eps,
                         HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                         BLOCK: tl.constexpr):
    # program (t, j): head j of row t, a q head for j < NH, else a k head
    t = tl.program_id(0)
    j = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    inside = i < HALF
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        first, second = 2 * i, 2 * i + 1
    else:  # halves
        first, second = i, i + HALF
    head = qkv_ptr + t.to(tl.int64) * row_len + j * HD
    x1 = tl.load(head + first, mask=inside, other=0.0)
    x2 = tl.load(head + second, mask=inside, other=0.0)
    if HAS_NORM:
        is_q = j < NH  # both norms are head_dim long: read both, keep the head's
        w1 = tl.where(is_q, tl.load(qn_ptr + first, mask=inside, other=0.0),
                      tl.load(kn_ptr + first, mask=inside, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + second, mask=inside, other=0.0),
                      tl.load(kn_ptr + second, mask=inside, other=0.0)).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
        x1 = x1 * r * w1
        x2 = x2 * r * w2
    c = tl.load(cos_ptr + t * HALF + i, mask=inside, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=inside, other=0.0)
    tl.store(head + first, x1 * c - x2 * s, mask=inside)
    tl.store(head + second, x2 * c + x1 * s, mask=inside)


_RESIDUAL_NORM = triton_support.Kernel(_residual_norm_source)
_QK_NORM_ROPE = triton_support.Kernel(_qk_norm_rope_source)
_ATTEND = triton_support.Kernel(_attend_source)
_ATTEND_MERGE = triton_support.Kernel(_attend_merge_source)
_STORE_KV = triton_support.Kernel(_store_kv_source, helpers=("bf16_bits",))
