"""A transformer block's forward on the CPU with fused kernels: `Block.forward`, in fewer calls.

Same math as models/transformer.py's `Block.forward` (its reference), reorganised for batch-1
decode, where the number of PyTorch dispatches, not arithmetic, sets the cost of everything but
the matmuls:
- q, k and v come from one projection (`Attention.wqkv`), then one call norms and rotates the
  q/k heads in place;
- each residual step (post-norm, add, and the next sub-layer's norm) is one call;
- each query row (decoding, or a row of a speculative tree) attends over keys read in place
  from the paged pool (`Attention.single_query`), without gathering them first; the whole
  attention sub-layer of a decoded token or of a tree's rows is one call (prefill runs it op
  by op);
- a dense FFN on quantized rows is one call with its residual step, for any number of rows.
Any other FFN (a hybrid one, a wrapper, one with hooks) runs as the block's own module.
Every op is row by row, which keeps a body pass batch-invariant (speculative verification
relies on it).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import fused_ops
from ember.models.transformer import Block, FeedForward
from ember.models.tree_rows import TreeRows


class FusedBlock(nn.Module):
    def __init__(self, block: Block):
        super().__init__()
        object.__setattr__(self, "block", block)  # not a submodule: no cycle, `.to()` skips it
        object.__setattr__(self, "attn", block.attn)  # (read every token: no module lookup)
        self.one_call = True  # decode and tree rows' attention in one C++ call (False: op by op)
        # attention_step's fixed arguments, from the first decoded token on. The weights do
        # not change under a FusedBlock: quant_body.use_body makes a new one when they do.
        self._weights: tuple | None = None

    def forward(self, x: torch.Tensor, start: int, cache, tree: TreeRows | None = None):
        b = self.block
        attn, cfg, eps = b.attn, b.cfg, b.cfg.rms_eps
        sandwich = cfg.sandwich_norms
        if (self.one_call and (x.shape[0] == 1 or tree is not None) and attn.reads_in_place(cache)
                and isinstance(getattr(attn.wo, "rows", None), torch.Tensor)):
            x, h = self._attention_step(x, start, cache, tree)
            return self._ffn_step(x, h)
        h = fused_ops.rms_norm(x, b.attn_norm, eps)
        qkv = attn.wqkv(h)
        T = qkv.shape[0]
        cos, sin = attn.rotary.tables(start if tree is None else tree.positions, T, qkv.device)
        fused_ops.qk_norm_rope_(qkv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                attn.q_norm if cfg.qk_norm else None,
                                attn.k_norm if cfg.qk_norm else None,
                                cos, sin, attn.rotary.interleaved, eps)
        q, k, v = qkv.split(attn.qkv_sizes, dim=1)
        q = q.view(T, cfg.n_heads, cfg.head_dim)
        k = k.view(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.n_kv_heads, cfg.head_dim)
        a = attn.wo(attn.attend_rotated(q, k, v, start, cache, tree))
        x, h = fused_ops.residual_norm(x, a, b.post_attn_norm if sandwich else None,
                                       b.ffn_norm, eps)
        return self._ffn_step(x, h)

    def _attention_step(self, x: torch.Tensor, start: int, cache, tree: TreeRows | None):
        """The attention sub-layer of one decoded row or of a tree's rows in one C++ call: the
        ops above, same order, same bits."""
        if self._weights is None:
            self._weights = self._attention_weights()
        before, after = self._weights
        slots, cos, sin = self.row_inputs(start, cache, tree, x.device)
        return fused_ops.attention_step(x, *before, cos, sin, self.attn.rotary.interleaved,
                                        *cache.pools(), slots, *after)

    def row_inputs(self, start: int, cache, tree: TreeRows | None, device: torch.device):
        """(pool slots of each row, cos, sin) of a decoded token at `start` (one row), or of
        a tree's rows, whose keys and rotary positions come from the tree. A row's own slot
        is its last."""
        attn = self.attn
        if tree is None:
            lo = 0 if attn.window is None else max(0, start - attn.window + 1)
            cos, sin = attn.rotary.tables(start, 1, device)
            return [cache.slots_of(attn.layer, lo, start + 1)], cos, sin
        key = ("rotary", id(attn.rotary))  # layers sharing a rotary table share these
        if key not in tree.memo:
            tree.memo[key] = attn.rotary.tables(tree.positions, tree.positions.shape[0], device)
        return (attn.tree_slots(cache, tree), *tree.memo[key])

    def _attention_weights(self) -> tuple[tuple, tuple]:
        """attention_step's fixed arguments, gathered once (each module attribute lookup
        costs a microsecond, and a decoded token makes hundreds): those before the rotary
        tables, and those after the slots."""
        b = self.block
        attn, cfg = b.attn, b.cfg
        before = (b.attn_norm, attn.wqkv.rows, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                  attn.q_norm if cfg.qk_norm else None, attn.k_norm if cfg.qk_norm else None)
        after = (attn.wo.rows, b.post_attn_norm if cfg.sandwich_norms else None, b.ffn_norm,
                 cfg.rms_eps, cfg.scale)
        return before, after

    def body_layer(self) -> fused_ops.BodyLayer:
        """This block's arguments for fused_ops.body_step (offload/body/fused_body.py); its FFN
        must be a plain one on Q8_0 rows (see plain_ffn)."""
        b = self.block
        ffn, cfg = b.ffn.fast, b.cfg
        before, (wo_rows, post_attn, ffn_norm, eps, scale) = self._attention_weights()
        return fused_ops.BodyLayer(*before, b.attn.rotary.interleaved, wo_rows, post_attn,
                                   ffn_norm, ffn.gate_up, ffn.down, ffn.activation,
                                   b.post_ffn_norm if cfg.sandwich_norms else None, eps, scale)

    def _ffn_step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        b = self.block
        post = b.post_ffn_norm if b.cfg.sandwich_norms else None
        ffn = b.ffn
        # A plain dense FFN on quantized rows goes through one call with the residual step
        # (BlockFeedForward.residual_step), for every row count, so decode and tree rows agree.
        # Anything else (a hybrid FFN, a wrapper, hooks to fire) runs as a module.
        if plain_ffn(ffn):
            return ffn.fast.residual_step(x, h, post, b.cfg.rms_eps)
        x, _ = fused_ops.residual_norm(x, ffn(h).contiguous(), post, None, b.cfg.rms_eps)
        return x


def plain_ffn(ffn: nn.Module) -> bool:
    """A dense FeedForward on Q8_0 rows (quant_body.BlockFeedForward) with no hooks to fire:
    one that runs as a single C++ call."""
    return (type(ffn) is FeedForward and hasattr(ffn.fast, "residual_step")
            and not (ffn._forward_hooks or ffn._forward_pre_hooks))


# Attention's `single_query` hook: one row's attention read in place from the paged pool.
single_query = fused_ops.attend_slots


def applies(block: Block) -> bool:
    """The fused forward needs a fused q/k/v projection, CPU tensors and the C++ kernels.
    Its attention_step has no q/k/v biases (Qwen 2) or soft-capped scores (Gemma 2): such
    blocks keep the reference forward (on the same Q8_0 projections)."""
    cfg = block.cfg
    return (block.attn.wqkv is not None and block.attn_norm.device.type == "cpu"
            and not cfg.qkv_bias and not cfg.attn_softcap and fused_ops.available())
