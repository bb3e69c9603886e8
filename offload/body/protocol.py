"""`BodyModel`: what the runner (offload/decode/runner.py) asks of the model it drives.

Two classes satisfy it: `FileBlocksModel` (offload/body/file_blocks_model.py, the file's own
blocks, the default runtime) and the float32 reference `Transformer` (models/transformer.py:
`--weights fp32`, a CUDA device without a tier budget). Both are built once for their
options; the runner only calls them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ember.models.config import ModelConfig
from ember.models.reference_cache import KVCache
from ember.models.tree_rows import TreeRows


@runtime_checkable
class BodyModel(Protocol):
    cfg: ModelConfig
    # Whether a T-row pass gives each row the bits a one-row pass gives (then a speculative
    # tree's rows are verified in one pass), and whether the LM head does.
    batch_invariant: bool
    head_batch_invariant: bool

    @property
    def device(self) -> torch.device:
        """Where token ids go (the embedding's host)."""

    def use_context(self, n_ctx: int) -> None:
        """Rotate for a context of `n_ctx` tokens (LongRoPE's factors follow it)."""

    def hidden(self, ids: torch.Tensor, cache: KVCache,
               tree: TreeRows | None = None) -> torch.Tensor:
        """ids (T,) at positions cache.length.. -> final-normed hidden states (T, hidden)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, vocab) float32."""
