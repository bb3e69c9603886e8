"""LM heads the runtime can swap into a loaded model (as gpt-fast swaps nn.Linear).

`QuantizedLMHead` multiplies straight from the file's Q8_0 blocks (the default model's tied
embedding is Q8_0): a quarter of the bytes of the float32 head, read once for all rows being
scored. Same products as the float reference; only the summation order differs, which the
tests check does not change greedy tokens on the fixture prompts.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import q8_matmul
from ember.models.transformer import LMHead, Transformer, softcap
from ember.models.weights import QTensor

HEAD_CHOICES = ("auto", "fp32", "q8_0")


class QuantizedLMHead(nn.Module):
    def __init__(self, stored: QTensor, cap: float | None):
        super().__init__()
        n, k = stored.shape
        self.stored = stored
        self.rows = q8_matmul.q8_0_rows(stored.raw, n, k)  # (vocab, row_bytes) view, no copy
        self.cap = cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The blocks live in host memory (the mapped file); CPU-tier compute reads them there.
        out = q8_matmul.q8_0_matmul(hidden.float().cpu(), self.rows).to(hidden.device)
        return softcap(out, self.cap)


def choose_lm_head(model: Transformer, choice: str = "auto") -> str:
    """Swap in the quantized head when asked (or on `auto`, when it applies: a Q8_0 head on
    the CPU with the C++ kernels built). Returns the head in use: "q8_0" or "fp32"."""
    if choice not in HEAD_CHOICES:
        raise ValueError(f"unknown LM head {choice!r}; choose one of {', '.join(HEAD_CHOICES)}")
    stored, cap = model.head.stored, model.cfg.final_logit_softcap
    applies = stored.qtype == q8_matmul.Q8_0 and model.device.type == "cpu"
    if choice == "fp32" or (choice == "auto" and not (applies and q8_matmul.available())):
        if isinstance(model.head, QuantizedLMHead):  # a model shared with an earlier engine
            model.head = LMHead(stored, cap)
        return "fp32"
    if not applies:
        from ember.models.errors import ConfigError

        raise ConfigError(f"--lm-head q8_0 needs a Q8_0 output matrix on the CPU; this model's "
                          f"is {stored.qtype_name} on {model.device.type}")
    if not isinstance(model.head, QuantizedLMHead):
        model.head = QuantizedLMHead(stored, cap)
    return "q8_0"
