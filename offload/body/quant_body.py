"""Quantized weights for the dense body, swapped in at load (as gpt-fast swaps nn.Linear).

Every projection of the body (attention q/k/v/o, FFN gate/up/down) runs through the Q8_0
kernel that also serves the LM head, on Q8_0 rows made at load: the file's own Q8_0 blocks,
Q4_0/Q5_0 blocks widened exactly (the same values), anything else (Q4_K, Q6_K, float files)
requantized from the dequantized values. A quarter of the float32 bytes per token; 8 bits
per weight on top of the file's 4-6 is near-lossless (perplexity and greedy tokens are tested).

Attention projections are `Projection` objects replaced by `BlockProjection` (q, k and v also as
one fused matrix, `Attention.wqkv`); a dense `FeedForward` keeps its float32 tensors (the
hybrid engine and the profiler read them) and gets a `BlockFeedForward` as its `fast` path; each
block gets the fused-kernel forward of offload/body/fused_block.py. `use_body(model, "fp32")` puts
everything back.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import fused_ops, q8_matmul
from ember.models.transformer import FeedForward, Projection, Transformer

from . import fused_block

from . import fused_body

BODY_CHOICES = ("auto", "fp32", "q8")
PROJECTIONS = ("wq", "wk", "wv", "wo")


def _block_rows(parts: list[torch.Tensor], stored: list) -> torch.Tensor:
    """Q8_0 rows (sum of outs, row_bytes) for the float32 (in, out) `parts` side by side (q, k
    and v, or gate and up, fuse this way). Each part comes from the file's blocks when they
    are Q8_0 or widen to it exactly (no rounding beyond the file's own), else is requantized
    from the floats (rows are quantized independently, so parts can be done one by one)."""
    return torch.cat([_part_rows(part, s) for part, s in zip(parts, stored)])


def _part_rows(weight: torch.Tensor, stored) -> torch.Tensor:
    qtype = getattr(stored, "qtype", None)
    if qtype == q8_matmul.Q8_0:
        return stored.raw.view(stored.shape[0], -1)
    if qtype in q8_matmul.WIDENS_EXACTLY:
        return q8_matmul.widen_to_q8_0(stored.raw.view(stored.shape[0], -1), qtype)
    return q8_matmul.q8_0_quantize(weight.t())


class BlockProjection(nn.Module):
    """x (T, in) -> (T, out) from Q8_0 rows. `source`: the float32 Projection it replaces;
    `rows`: its rows when already made (a slice of a fused projection's); `bias` (out,), when
    given or the source has one."""

    def __init__(self, source: Projection | None, rows: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        object.__setattr__(self, "source", source)  # not a submodule: `.to()` leaves it alone
        if rows is None:
            rows = _block_rows([source.weight], [source.stored])
        if bias is None and source is not None:
            bias = source.bias
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = q8_matmul.q8_0_matmul(x, self.rows)
        return y if self.bias is None else y + self.bias


class BlockFeedForward(nn.Module):
    """A FeedForward's forward from Q8_0 rows; gate and up share one matrix (one call)."""

    def __init__(self, ffn: FeedForward):
        super().__init__()
        self.activation = ffn.activation
        stored = getattr(ffn, "stored", {})
        names = ("gate", "up") if ffn.gate is not None else ("up",)
        gate_up = _block_rows([getattr(ffn, n) for n in names], [stored.get(n) for n in names])
        down = _block_rows([ffn.down], [stored.get("down")])
        self.register_buffer("gate_up", gate_up, persistent=False)  # (2*ffn or ffn, bytes)
        self.register_buffer("down", down, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.dense_ffn(x, self.gate_up, self.down, self.activation)

    def residual_step(self, x: torch.Tensor, h: torch.Tensor, post_norm: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
        """x + (post-normed) forward(h) in one C++ call: the same bits as forward() followed
        by fused_ops.residual_norm."""
        return fused_ops.ffn_step(x, h, self.gate_up, self.down, self.activation, post_norm, eps)


def _fits(*weights: torch.Tensor | None) -> bool:
    """Q8_0 rows need the input size to be a multiple of 32 (every common model's is)."""
    return all(w is None or w.shape[0] % q8_matmul.BLOCK == 0 for w in weights)


def use_body(model: Transformer, choice: str = "auto") -> str:
    """Run the body on Q8_0 weights ("q8") or the float32 reference ("fp32"); "auto" picks
    q8 when it applies (the model on the CPU and the C++ kernels built). Returns the choice
    in use. FFNs another runtime has replaced (hybrid ones) are left to it."""
    if choice not in BODY_CHOICES:
        raise ValueError(f"unknown body weights {choice!r}; choose one of {', '.join(BODY_CHOICES)}")
    applies = model.device.type == "cpu"
    if choice == "fp32" or (choice == "auto" and not (applies and q8_matmul.available())):
        _restore(model)
        return "fp32"
    if not applies:
        from ember.models.errors import ConfigError

        raise ConfigError(f"--weights q8 runs on the CPU; this model is on {model.device.type}")
    for block in model.blocks:
        attn = block.attn
        _fuse_qkv(attn)
        for name in PROJECTIONS:
            proj = getattr(attn, name)
            if type(proj) is Projection and _fits(proj.weight):
                setattr(attn, name, BlockProjection(proj))
        ffn = block.ffn
        if type(ffn) is not FeedForward:  # a split FFN: its dense twin, where it runs one
            ffn = getattr(ffn, "dense_fallback", lambda: None)()
        if (isinstance(ffn, FeedForward) and ffn.fast is None
                and _fits(ffn.gate, ffn.up, ffn.down)):
            ffn.fast = BlockFeedForward(ffn)
        if block.fast is None and fused_block.applies(block):
            block.fast = fused_block.FusedBlock(block)
            attn.single_query = fused_block.single_query
    model.fast_body = fused_body.FusedBody(model) if fused_body.applies(model) else None
    return "q8"


def _fuse_qkv(attn) -> None:
    """One Q8_0 matrix for q, k and v (`attn.wqkv`); wq/wk/wv become views of its rows, so
    the bytes are held once and the separate projections still work."""
    parts = [getattr(attn, name) for name in ("wq", "wk", "wv")]
    if attn.wqkv is not None or any(type(p) is not Projection or not _fits(p.weight) for p in parts):
        return
    rows = _block_rows([p.weight for p in parts], [p.stored for p in parts])
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    attn.wqkv = BlockProjection(None, rows, bias)
    first = 0
    for name, proj, size in zip(("wq", "wk", "wv"), parts, attn.qkv_sizes):
        setattr(attn, name, BlockProjection(proj, rows[first:first + size]))
        first += size


def _restore(model: Transformer) -> None:
    model.fast_body = None
    for block in model.blocks:
        block.fast = None
        block.attn.wqkv = block.attn.single_query = None
        for name in PROJECTIONS:
            proj = getattr(block.attn, name)
            if isinstance(proj, BlockProjection):
                setattr(block.attn, name, proj.source)
        # The block's FFN, or the dense twin a split FFN keeps (not a submodule).
        dense = block.ffn if isinstance(block.ffn, FeedForward) else getattr(block.ffn, "source", None)
        if isinstance(dense, FeedForward):
            dense.fast = None


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: the body's projections and FFNs as they run
    now (quantized or float32) plus the LM head. Norms and the embedding row are left out
    (under 0.1%)."""
    total = 0
    for block in model.blocks:
        for name in PROJECTIONS:
            total += _buffer_bytes(getattr(block.attn, name))
        ffn = block.ffn
        if isinstance(ffn, FeedForward) and ffn.fast is not None:
            ffn = ffn.fast
        total += _buffer_bytes(ffn)
    head = getattr(model.head, "inner", model.head)  # a head kept in host RAM is still read
    rows = getattr(head, "rows", None)  # the Q8_0 head
    if rows is not None:
        return total + rows.numel() * rows.element_size()
    return total + model.cfg.vocab_size * model.cfg.hidden_size * 4  # the float32 head


def _buffer_bytes(module: nn.Module) -> int:
    # A FeedForward's own tensors only, not those of its `fast` twin.
    recurse = not isinstance(module, FeedForward)
    return sum(b.numel() * b.element_size() for b in module.buffers(recurse=recurse))
