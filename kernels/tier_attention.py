"""One decoder layer's attention on the GPU tier, its weights in a tier format, K/V in a
16-bit type.

The tier holds per layer, in one format (the file's own blocks, kernels/tier_blocks.py; int8
or int4 codes or bf16/fp16/fp32 values, kernels/tier_weights.py):

    qkv   W (q + 2 kv columns, hidden)   q, k and v projections, outputs side by side
    o     W (hidden, q columns)
    norms attention input, FFN input (and the sandwich norms, q/k head norms), the qkv bias

and the layer reads and writes its K/V in the paged pool on the same device. For T rows:

    h = rms_norm(x, attn_norm); qkv = h @ W_qkv^T (+ bias)     the format's matmul, out float32
    q/k head norms and rotary (float32); K/V stored in the pool's type at the rows' own slots
    o = attention of q over the pool rows `rows.keys`, row t seeing those `rows.mask[t]` allows
    x' = x + post-normed (o @ W_o^T); h' = rms_norm(x', ffn_norm)          returns (x', h')

The attention itself is computed in float32 from the pool's values (as the host runtime
does from its float16 pool): the K/V and weights are rounded once, when stored, and nothing
else. All rows go through one masked attention, so a prompt chunk or a tree costs one call
per layer whatever T is. `tier_attention_reference` is the same layer row by row from the
float values the stored weights stand for, through the fused ops' plain references.

Model-agnostic: tensors and switches in, the caller (offload/body/) reads its model. Nothing
here imports a GPU library: the tensors' device decides where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import tier_layer_triton, triton_support
from .attention import attend_reference
from .fused_ops import (qk_norm_rope_reference, residual_norm_reference,
                        rms_norm_reference)
from .tier_weights import TierLinear

TIER_TYPES = (torch.bfloat16, torch.float16, torch.float32)
# The layer's vectors: its norms and the q/k/v bias
_VECTORS = ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm",
          "qkv_bias")


def attention_bytes(hidden: int, q_cols: int, kv_cols: int, head_dim: int, dtype: torch.dtype,
                    qkv_bias: bool = False, qk_norm: bool = False,
                    sandwich: bool = False) -> int:
    """Exact bytes of one layer's `TierAttentionWeights` in `dtype`: what the memory plan
    charges for it (tested against the tensors' nbytes)."""
    values = (q_cols + 2 * kv_cols) * hidden + hidden * q_cols  # W_qkv and W_o
    values += (4 if sandwich else 2) * hidden  # attention and FFN input norms (+ post norms)
    values += 2 * head_dim if qk_norm else 0
    values += q_cols + 2 * kv_cols if qkv_bias else 0
    return values * dtype.itemsize


@dataclass(frozen=True)
class AttendRows:
    """Which pool rows a pass of T rows reads and writes, in one layer.

    keys (S,): the pool rows any row reads, in position order; own (T,): the row each row's
    K/V is written to (each row reads its own too); mask (T, S) bool: which keys each row
    sees, None when every row sees all of them (one decoded token). span (2,) int64 on the
    keys' device, one row and no mask: the row reads keys[span[0]:span[0] + span[1]] only,
    a count the kernel reads on the device (the fixed inputs a CUDA graph replays,
    offload/body/tier_graph.py)."""

    keys: torch.Tensor
    own: torch.Tensor
    mask: torch.Tensor | None
    span: torch.Tensor | None = None

    @staticmethod
    def causal_mask(lo: int, start: int, T: int, window: int | None,
                    device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Rows at positions start..start+T-1 over keys at positions lo..start+T-1: each
        sees the keys up to its own position and, with a window, inside it. None for one
        row (the caller gives it only what it sees)."""
        if T == 1:
            return None
        q_pos = torch.arange(start, start + T)[:, None]
        k_pos = torch.arange(lo, start + T)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        return mask.to(device)

    @staticmethod
    def listed_mask(positions: list[torch.Tensor], n_keys: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Row t reads the keys at `positions[t]` (indices among n_keys), its own last (a
        speculative tree's rows, each with its ancestors): (mask (T, n_keys), the index of
        each row's own key (T,))."""
        mask = torch.zeros(len(positions), n_keys, dtype=torch.bool)
        for t, pos in enumerate(positions):
            mask[t, pos] = True
        own = torch.stack([pos[-1] for pos in positions])
        return mask.to(device), own.to(device)

    def spanned(self) -> torch.Tensor:
        """The keys read when every row reads all of them (no mask): `keys`, or its span
        (read back to the host: not for a graph's capture)."""
        if self.span is None:
            return self.keys
        lo, n = self.span.tolist()
        return self.keys[lo:lo + n]

    def per_row(self) -> list[torch.Tensor]:
        """Each row's pool rows, in key order (its own last): the reference's form."""
        if self.mask is None:
            return [self.spanned()]
        return [self.keys[m] for m in self.mask]


@dataclass(frozen=True)
class TierAttentionWeights:
    """One layer's attention weights on the tier (see the module docstring).

    `qkv` and `o` are tier matrices: a `TierLinear` (kernels/tier_weights.py: bf16, fp16,
    fp32, int8 or int4 codes) or a `TierBlocks` (kernels/tier_blocks.py: the file's own
    blocks); each is called x (T, K) -> (T, N) and states its bytes and its conversion error
    against the float values it was made from (the file's, dequantized; 0 for the file's
    blocks). Norms and the bias are in `dtype` (the float formats' type, else float32)."""

    qkv: object
    o: object
    norms: dict  # name -> (D,) tensor in `dtype`, only those the layer has (_VECTORS)
    n_heads: int
    n_kv: int
    head_dim: int
    interleaved: bool
    eps: float
    scale: float
    softcap: float

    @classmethod
    def pack(cls, qkv: torch.Tensor, o: torch.Tensor, norms: dict, n_heads: int, n_kv: int,
             head_dim: int, interleaved: bool, eps: float, scale: float, softcap: float = 0.0,
             device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16, fmt: str | None = None,
             half: torch.dtype = torch.bfloat16) -> "TierAttentionWeights":
        """From float values on the host: qkv (q + 2 kv columns, hidden), o (hidden, q
        columns), `norms` name -> (D,) or None (a step the layer skips). `fmt` None: the
        weights in `dtype`; "int8"/"int4": those codes (scales and activations in `half`),
        the norms float32."""
        if fmt is None:
            if dtype not in TIER_TYPES:
                raise ValueError(f"tier attention holds bf16, fp16 or fp32, not {dtype}")
            fmt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        else:
            dtype = torch.float32
        return cls.of(TierLinear.pack(qkv, fmt, device, half),
                      TierLinear.pack(o, fmt, device, half), norms, n_heads, n_kv, head_dim,
                      interleaved, eps, scale, softcap, dtype)

    @classmethod
    def of(cls, qkv, o, norms: dict, n_heads: int, n_kv: int, head_dim: int,
           interleaved: bool, eps: float, scale: float, softcap: float = 0.0,
           dtype: torch.dtype = torch.float32) -> "TierAttentionWeights":
        """From tier matrices made already (e.g. `TierBlocks` of the file's q/k/v and o),
        the vectors stored beside them on their device in `dtype`."""
        unknown = set(norms) - set(_VECTORS)
        if unknown:
            raise ValueError(f"unknown attention tensors {sorted(unknown)}")
        kept = {k: v.float().to(dtype).contiguous().to(qkv.device) for k, v in norms.items()
                if v is not None}
        return cls(qkv, o, kept, n_heads, n_kv, head_dim, interleaved, eps, scale, softcap)

    @property
    def fmt(self) -> str:
        return self.qkv.fmt

    @property
    def dtype(self) -> torch.dtype:
        """The vectors' type (the weights' too in a float format)."""
        return self.norms["attn_norm"].dtype

    @property
    def device(self) -> torch.device:
        return self.qkv.device

    @property
    def error(self) -> dict:
        return {"qkv": self.qkv.error, "o": self.o.error}

    def tensors(self) -> list[torch.Tensor]:
        return [*self.qkv.tensors.values(), *self.o.tensors.values(), *self.norms.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def norm(self, name: str) -> torch.Tensor | None:
        return self.norms.get(name)

    def dequantized(self) -> "TierAttentionWeights":
        """The same layer with float32 copies of the stored values on the host (the
        reference's weights: what the stored ones stand for)."""
        return TierAttentionWeights(
            TierLinear.pack(self.qkv.dequantize(), "fp32"),
            TierLinear.pack(self.o.dequantize(), "fp32"),
            {k: v.float().cpu() for k, v in self.norms.items()}, self.n_heads, self.n_kv,
            self.head_dim, self.interleaved, self.eps, self.scale, self.softcap)


def available() -> bool:
    """Always: plain torch ops on whatever device the weights are (the kernel convention's
    `available()`)."""
    return True


def _project_qkv(w: TierAttentionWeights, x: torch.Tensor, cos, sin,
                 ops: LayerOps) -> torch.Tensor:
    """x (T, hidden) float32 -> qkv (T, q + 2 kv) float32, q/k normed and rotated."""
    h = ops.rms_norm(x, w.norms["attn_norm"], w.eps)
    qkv = w.qkv(h).float()
    bias = w.norm("qkv_bias")
    if bias is not None:
        qkv = qkv + bias
    ops.qk_norm_rope_(qkv, w.n_heads, w.n_kv, w.head_dim, w.norm("q_norm"), w.norm("k_norm"),
                      cos, sin, w.interleaved, w.eps)
    return qkv


def _store_kv(qkv: torch.Tensor, n_heads: int, n_kv: int, hd: int, k_pool, v_pool,
              own: torch.Tensor) -> None:
    """Writes the rows' K/V at `own`, in the pool's type."""
    T = qkv.shape[0]
    _q, k, v = qkv.split((n_heads * hd, n_kv * hd, n_kv * hd), dim=1)
    k_pool.index_copy_(0, own, k.reshape(T, n_kv, hd).to(k_pool.dtype))
    v_pool.index_copy_(0, own, v.reshape(T, n_kv, hd).to(v_pool.dtype))


def _stored_q(w: TierAttentionWeights, qkv: torch.Tensor, k_pool, v_pool, own, ops):
    """The rows' K/V written at `own` (in the pool's type); returns q (T, n_heads, hd), a view."""
    ops.store_kv(qkv, w.n_heads, w.n_kv, w.head_dim, k_pool, v_pool, own)
    return qkv[:, :w.n_heads * w.head_dim].view(qkv.shape[0], w.n_heads, w.head_dim)


def _finish(w: TierAttentionWeights, x: torch.Tensor, o: torch.Tensor, ops: LayerOps):
    a = w.o(o).float()
    return ops.residual_norm(x, a, w.norm("post_attn_norm"), w.norms["ffn_norm"], w.eps)


def _attend_pooled(q, k_pool, v_pool, rows: AttendRows, scale: float, softcap: float):
    """The rows' keys and values gathered from the pools as float32, then one masked
    attention (`_attend`): (T, n_heads * hd)."""
    read = rows.spanned()
    keys = k_pool.index_select(0, read).float()  # (S, n_kv, hd)
    values = v_pool.index_select(0, read).float()
    return _attend(q, keys, values, rows.mask, scale, softcap)


def _attend_triton(q, k_pool, v_pool, rows: AttendRows, scale: float, softcap: float):
    """A token or a draft tree read straight from the pools (kernels/tier_layer_triton.py);
    a prompt's rows through `_attend_pooled`."""
    if q.shape[0] > tier_layer_triton.ATTEND_ROWS:
        return _attend_pooled(q, k_pool, v_pool, rows, scale, softcap)
    return tier_layer_triton.attend(q, k_pool, v_pool, rows.keys, rows.mask, scale, softcap,
                                    rows.span)


@dataclass(frozen=True)
class LayerOps:
    """A tier layer's steps around its matrices: plain torch ops (the references; the host,
    and the reference layer), or one Triton kernel each on a CUDA tier
    (kernels/tier_layer_triton.py)."""

    rms_norm: object
    residual_norm: object
    qk_norm_rope_: object
    store_kv: object  # (qkv, n_heads, n_kv, hd, k_pool, v_pool, own) -> None
    attend: object  # (q, k_pool, v_pool, rows, scale, softcap) -> (T, n_heads * hd)


REFERENCE_OPS = LayerOps(rms_norm_reference, residual_norm_reference, qk_norm_rope_reference,
                         _store_kv, _attend_pooled)
TRITON_OPS = LayerOps(tier_layer_triton.rms_norm, tier_layer_triton.residual_norm,
                      tier_layer_triton.qk_norm_rope_, tier_layer_triton.store_kv,
                      _attend_triton)


def layer_ops(device: torch.device) -> LayerOps:
    """The steps a tier on `device` runs: Triton's where it runs (kernels/triton_support.py)
    and its kernels pass their check against the references there, else the references."""
    if triton_support.usable(device) and \
            triton_support.checked("layer", device, tier_layer_triton.self_check):
        return TRITON_OPS
    return REFERENCE_OPS


def tier_attention(w: TierAttentionWeights, x: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, rows: AttendRows, cos: torch.Tensor,
                   sin: torch.Tensor, ops: LayerOps | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention sub-layer for T rows x (T, hidden) float32 on w's device: (x +
    post-normed attention, the FFN-normed input), both float32. Pools (rows, n_kv, hd) on
    the same device; cos/sin (T, hd / 2) the rows' rotary tables; `ops` the small steps
    (default: `layer_ops` of w's device)."""
    ops = ops or layer_ops(w.device)
    q = _stored_q(w, _project_qkv(w, x, cos, sin, ops), k_pool, v_pool, rows.own, ops)
    return _finish(w, x, ops.attend(q, k_pool, v_pool, rows, w.scale, w.softcap), ops)


def _attend(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """q (T, n_heads, hd), k/v (S, n_kv, hd) float32, mask (T, S) or None -> (T, n_heads * hd)."""
    T, n_heads, hd = q.shape
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    if softcap:  # written out: scaled_dot_product_attention has no hook before the softmax
        group = n_heads // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = torch.tanh(q @ k.transpose(1, 2) * scale / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
    else:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                             scale=scale, enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(T, n_heads * hd)


def tier_attention_reference(w: TierAttentionWeights, x: torch.Tensor, k_pool: torch.Tensor,
                             v_pool: torch.Tensor, rows: AttendRows, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tier_attention` row by row in float32 on the host, from the values the stored
    weights stand for: every row's K/V written first, then each row attends to its own keys
    (`rows.per_row()`) through kernels.attention's reference (what the host runtime computes)."""
    w = w.dequantized()
    x = x.float().cpu()
    qkv = _project_qkv(w, x, cos.cpu(), sin.cpu(), REFERENCE_OPS)
    q = _stored_q(w, qkv, k_pool, v_pool, rows.own, REFERENCE_OPS)
    o = attend_reference(q, k_pool, v_pool, rows.per_row(), None, w.scale, w.softcap)
    return _finish(w, x, o, REFERENCE_OPS)
