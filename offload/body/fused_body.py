"""Every block's forward in one C++ call for a decoded token or a speculative tree's rows.

The per-block fused path (offload/body/fused_block.py) still returns to Python twice per layer. At
batch 1 those returns cost more than their own instructions: measured on the default model,
the Python between the C++ calls took ~0.6 ms per token run alone but ~2 ms inside a real
decode step. Here Python only gathers each layer's slots and rotary tables; one call reads a
Q8_0 embedding row, and `fused_ops.body_step` runs the same attention_step and ffn_step calls
in a C++ loop: the same bits as block by block.

It applies to models whose every block runs the fused path with a plain FFN on Q8_0 rows, as
long as nothing needs the blocks run as modules: forward hooks (on a block, its FFN, or
global ones), a block switched to op by op, or an FFN another runtime replaced since. Then
`__call__` returns None and the blocks run one by one.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as nn_module

from ember.kernels import fused_ops, q8_matmul
from ember.models.transformer import Transformer
from ember.models.tree_rows import TreeRows

from .fused_block import FusedBlock, plain_ffn


def applies(model: Transformer) -> bool:
    return all(isinstance(b.fast, FusedBlock) and plain_ffn(b.ffn)
               and isinstance(getattr(b.attn.wo, "rows", None), torch.Tensor) for b in model.blocks)


class FusedBody:
    def __init__(self, model: Transformer):
        blocks = list(model.blocks)
        # What the blocks were when the body was built: any later change falls back.
        self._parts = [(b, b.fast, b.ffn, b.ffn.fast) for b in blocks]
        self._fused = [b.fast for b in blocks]
        self._first_attn = blocks[0].attn
        self._run = fused_ops.body_step([b.fast.body_layer() for b in blocks])
        self._model = model
        # A Q8_0 embedding (the default model's, tied to its LM head) is read in one call.
        emb = model.embedding
        self._embedding_rows = None
        if emb.qtype == q8_matmul.Q8_0 and model.device.type == "cpu":
            self._embedding_rows = q8_matmul.q8_0_rows(emb.raw, *emb.shape)

    def __call__(self, ids: torch.Tensor, start: int, cache,
                 tree: TreeRows | None = None) -> torch.Tensor | None:
        """One decoded token id (1,), or a tree's rows, embedded and run through every block;
        None when the blocks must run one by one."""
        if ((ids.shape[0] != 1 and tree is None) or not self._unchanged()
                or not self._first_attn.reads_in_place(cache)):
            return None
        if self._embedding_rows is not None and ids.shape[0] == 1:
            x = q8_matmul.q8_0_embed(self._embedding_rows, int(ids[0]), self._model.cfg.embed_scale)
        else:
            x = self._model.embed(ids)
        slots, cos, sin = [], [], []
        for fused in self._fused:
            s, c, n = fused.row_inputs(start, cache, tree, x.device)
            slots.append(s)
            cos.append(c)
            sin.append(n)
        return self._run(x, *cache.pools(), slots, cos, sin)

    def _unchanged(self) -> bool:
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return False
        # Read through _modules, the dict nn.Module's attribute lookup searches: this runs
        # every token, and 18 layers of attribute lookups took ~0.1 ms.
        for block, fused, ffn, quantized in self._parts:
            modules = block._modules
            if (modules["fast"] is not fused or modules["ffn"] is not ffn
                    or ffn._modules["fast"] is not quantized or not fused.one_call
                    or block._forward_hooks or block._forward_pre_hooks
                    or ffn._forward_hooks or ffn._forward_pre_hooks):
                return False
        return True
