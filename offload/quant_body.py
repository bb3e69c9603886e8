"""Quantized weights for the dense body, swapped in at load (as gpt-fast swaps nn.Linear).

Every projection of the body (attention q/k/v/o, FFN gate/up/down) runs through the block
kernel that also serves the LM head: straight from the file's blocks where it reads their
type (Q5_0, Q8_0), else requantized from the dequantized values (Q4_K, Q6_K, float files) to
Q8_0: a fifth to a quarter of the float32 bytes per token. 8 bits per weight on top of the
file's 4-6 is near-lossless (perplexity and greedy tokens are tested).

Attention projections are `Projection` objects replaced by `BlockProjection` (q, k and v also as
one fused matrix, `Attention.wqkv`); a dense `FeedForward` keeps its float32 tensors (the
hybrid engine and the profiler read them) and gets a `BlockFeedForward` as its `fast` path; each
block gets the fused-kernel forward of offload/fused_block.py. `use_body(model, "fp32")` puts
everything back.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import q8_matmul
from ember.models.transformer import FeedForward, Projection, Transformer, activate

from . import fused_block

BODY_CHOICES = ("auto", "fp32", "q8")
PROJECTIONS = ("wq", "wk", "wv", "wo")


def _rows(weight: torch.Tensor) -> torch.Tensor:
    """A float32 (in, out) projection weight -> (out, row_bytes) Q8_0 rows."""
    return q8_matmul.q8_0_quantize(weight.t())


def _block_rows(parts: list[torch.Tensor], stored: list) -> tuple[torch.Tensor, int]:
    """One matrix of rows for the float32 (in, out) `parts` side by side: the file's own
    blocks when every part is stored in one type the kernel reads (Q5_0 on the default model:
    fewer bytes than Q8_0 and no requantization), else Q8_0 requantized from the floats.
    Returns (rows (sum of outs, row_bytes) uint8, GGML type)."""
    kinds = {getattr(s, "qtype", None) for s in stored}
    if len(kinds) == 1 and kinds <= set(q8_matmul.KERNEL_TYPES):
        qtype = kinds.pop()
        return torch.cat([s.raw.view(s.shape[0], -1) for s in stored]).contiguous(), qtype
    weight = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return _rows(weight), q8_matmul.Q8_0


class BlockProjection(nn.Module):
    """x (T, in) -> (T, out) from rows of quantized blocks (Q8_0, or the file's own Q5_0).
    `source`: the float32 Projection it replaces; `rows`: its rows when already made (a
    slice of a fused projection's)."""

    def __init__(self, source: Projection | None, rows: torch.Tensor | None = None,
                 qtype: int = q8_matmul.Q8_0):
        super().__init__()
        object.__setattr__(self, "source", source)  # not a submodule: `.to()` leaves it alone
        if rows is None:
            rows, qtype = _block_rows([source.weight], [source.stored])
        self.register_buffer("rows", rows, persistent=False)
        self.qtype = qtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q8_matmul.block_matmul(x, self.rows, self.qtype)


class BlockFeedForward(nn.Module):
    """A FeedForward's forward from quantized rows; gate and up share one matrix (one call)."""

    def __init__(self, ffn: FeedForward):
        super().__init__()
        self.activation, self.gated = ffn.activation, ffn.gate is not None
        self.ffn_size = ffn.up.shape[1]
        stored = getattr(ffn, "stored", {})
        names = ("gate", "up") if self.gated else ("up",)
        gate_up, self.gate_up_type = _block_rows([getattr(ffn, n) for n in names],
                                                 [stored.get(n) for n in names])
        down, self.down_type = _block_rows([ffn.down], [stored.get("down")])
        self.register_buffer("gate_up", gate_up, persistent=False)  # (2*ffn or ffn, bytes)
        self.register_buffer("down", down, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = q8_matmul.block_matmul(x, self.gate_up, self.gate_up_type)  # (T, 2*ffn) or (T, ffn)
        gate, up = (gu[:, :self.ffn_size], gu[:, self.ffn_size:]) if self.gated else (None, gu)
        return q8_matmul.block_matmul(activate(self.activation, gate, up), self.down,
                                      self.down_type)


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
        if ffn is not None and ffn.fast is None and _fits(ffn.gate, ffn.up, ffn.down):
            ffn.fast = BlockFeedForward(ffn)
        if block.fast is None and fused_block.applies(block):
            block.fast = fused_block.FusedBlock(block)
            attn.single_query = fused_block.single_query
    return "q8"


def _fuse_qkv(attn) -> None:
    """One Q8_0 matrix for q, k and v (`attn.wqkv`); wq/wk/wv become views of its rows, so
    the bytes are held once and the separate projections still work."""
    parts = [getattr(attn, name) for name in ("wq", "wk", "wv")]
    if attn.wqkv is not None or any(type(p) is not Projection or not _fits(p.weight) for p in parts):
        return
    rows, qtype = _block_rows([p.weight for p in parts], [p.stored for p in parts])
    attn.wqkv = BlockProjection(None, rows, qtype)
    first = 0
    for name, proj, size in zip(("wq", "wk", "wv"), parts, attn.qkv_sizes):
        setattr(attn, name, BlockProjection(proj, rows[first:first + size], qtype))
        first += size


def _restore(model: Transformer) -> None:
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
