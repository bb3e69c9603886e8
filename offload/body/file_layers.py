"""A model file read as the file-blocks runtime runs it: every weight where the file keeps it.

`FileLayers.read` turns an opened file (`ModelSource`) into per-layer `DecoderLayer`s whose
projections are `QTensor` views of the file's bytes (its memory map, or their copy in RAM:
`--mmap`), the embedding and LM head in their blocks, and the norms as float32. Nothing is
dequantized or requantized, except a tensor of a type without a native kernel (Q2_K, Q3_K,
IQ*...): it is requantized to Q8_0 once, recorded in `derived` and logged. What runs these
layers, and where, is decided once when a `FileBlocksModel` is built over them
(offload/body/file_blocks_model.py); a hybrid split slices its FFN rows from them
(`ffn_rows`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember.kernels import block_matmul as bm
from ember.kernels import decoder_step, q8_matmul
from ember.models.config import ModelConfig
from ember.models.loader import ModelSource
from ember.models.quants import type_name
from ember.models.transformer import softcap
from ember.models.weights import QTensor, WeightStore

from .ffn_rows import FileFFNRows

log = logging.getLogger("ember.runtime")


def readable(w: WeightStore, name: str, shape: tuple[int, int], derived: dict[str, int]) -> QTensor:
    """Tensor `name` itself when the kernel reads its type; else a Q8_0 copy (or float32 when
    its rows are not whole Q8_0 blocks), recorded in `derived` (name -> bytes). A type Ember
    cannot decode at all is an error naming the file and tensor."""
    t = w.get(name, shape)
    if bm.supports(t.qtype):
        return t
    values = w.load(name, shape)
    if values.shape[-1] % q8_matmul.QUANT_BLOCK == 0:
        rows = q8_matmul.q8_0_quantize(values)
        copy = QTensor(rows.reshape(-1), q8_matmul.Q8_0, t.shape)
    else:
        copy = QTensor.from_torch(values)
    derived[name] = copy.nbytes
    return copy


class BlockLMHead:
    """hidden (T, H) -> logits (T, vocab) from the output matrix's own blocks, on the host
    (or on a CPU tier, which holds the same bytes)."""

    batch_invariant = True  # the block kernels compute each row alone

    def __init__(self, stored: QTensor, cap: float | None):
        self.stored, self.cap = stored, cap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(bm.block_matmul(hidden.float().contiguous(), [self.stored]), self.cap)

    def scores(self, hidden: torch.Tensor, rows: QTensor) -> torch.Tensor:
        """Logits over a subset of the vocabulary (`rows`, from `stored.select_rows`)."""
        if rows.shape[0] == 0:
            return hidden.new_empty(hidden.shape[0], 0)
        return softcap(bm.block_matmul(hidden.float().contiguous(), [rows]), self.cap)

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes


@dataclass
class FileLayers:
    """The file's tensors as the runtime reads them (see the module docstring)."""

    cfg: ModelConfig
    weights: WeightStore  # the file's tensors (for the tier's copies, and page release)
    embedding: QTensor  # (vocab, hidden), one row dequantized per token
    head: QTensor  # (vocab, hidden): the output matrix, or the embedding when tied
    output_norm: torch.Tensor
    layers: list[decoder_step.DecoderLayer]
    derived: dict[str, int]  # tensors requantized at load: name -> bytes

    @classmethod
    def read(cls, source: ModelSource) -> "FileLayers":
        cfg, w = source.config, source.weights
        derived: dict[str, int] = {}
        h = cfg.hidden_size
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        out = cls(cfg, w, w.get("token_embd.weight", (cfg.vocab_size, h)),
                  readable(w, head, (cfg.vocab_size, h), derived),
                  w.load("output_norm.weight", (h,)),
                  [_layer(cfg, w, i, derived) for i in range(cfg.n_layers)], derived)
        if derived:
            kinds = sorted({type_name(w.get(n).qtype) for n in derived})
            log.warning("ember: %s tensors are not read natively; %d of them were requantized "
                        "to Q8_0 at load (%.1f MB)", "/".join(kinds), len(derived),
                        sum(derived.values()) / 1e6)
        return out

    def ffn_rows(self) -> list[FileFFNRows]:
        """Each layer's FFN in the file's blocks, as a hybrid split reads its rows."""
        return [FileFFNRows(layer.gate_up, layer.down, layer.activation) for layer in self.layers]


def _layer(cfg: ModelConfig, w: WeightStore, i: int,
           derived: dict[str, int]) -> decoder_step.DecoderLayer:
    p, h, hd = f"blk.{i}.", cfg.hidden_size, cfg.head_dim

    def matrix(name: str, out_features: int, in_features: int) -> QTensor:
        return readable(w, p + name, (out_features, in_features), derived)

    def norm(name: str, n: int) -> torch.Tensor:  # (also the 1-D biases)
        return w.load(p + name, (n,))

    f, kv = cfg.ffn_size, cfg.n_kv_heads * hd
    bias = None
    if cfg.qkv_bias:  # one vector for the q, k and v outputs side by side
        bias = torch.cat([norm("attn_q.bias", cfg.n_heads * hd), norm("attn_k.bias", kv),
                          norm("attn_v.bias", kv)])
    gate_up = [matrix("ffn_gate.weight", f, h)] if cfg.gated else []
    gate_up.append(matrix("ffn_up.weight", f, h))
    return decoder_step.DecoderLayer(
        attn_norm=norm("attn_norm.weight", h),
        qkv=[matrix("attn_q.weight", cfg.n_heads * hd, h),
             matrix("attn_k.weight", cfg.n_kv_heads * hd, h),
             matrix("attn_v.weight", cfg.n_kv_heads * hd, h)],
        n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=hd,
        q_norm=norm("attn_q_norm.weight", hd) if cfg.qk_norm else None,
        k_norm=norm("attn_k_norm.weight", hd) if cfg.qk_norm else None,
        interleaved=cfg.rope_interleaved,
        wo=matrix("attn_output.weight", h, cfg.n_heads * hd),
        post_attn_norm=norm("post_attention_norm.weight", h) if cfg.sandwich_norms else None,
        ffn_norm=norm("ffn_norm.weight", h),
        gate_up=gate_up, down=matrix("ffn_down.weight", h, f), activation=cfg.activation,
        post_ffn_norm=norm("post_ffw_norm.weight", h) if cfg.sandwich_norms else None,
        eps=cfg.rms_eps, scale=cfg.scale, qkv_bias=bias,
        attn_softcap=cfg.attn_softcap or 0.0)


def file_bytes_per_token(cfg: ModelConfig, weights: WeightStore) -> int:
    """What one decode step must read of the file as it is stored: every layer's projections
    and the LM head (a tied head reads the embedding matrix)."""
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    total = weights.get(head).nbytes
    for name in weights.names():
        t = weights.get(name)
        if name.startswith("blk.") and not name.endswith("norm.weight") and len(t.shape) == 2:
            total += t.nbytes
    return total
