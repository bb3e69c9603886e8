"""What GLU calibration measures (predictors/glu_calibration.py): a layer's local error at each
candidate sparsity (step 1), and the dense model's KL divergence and NLL change when layers
are thresholded, re-running only the blocks from the first changed layer on (steps 2-4),
scored on a shortlist of the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember.models.support.errors import ConfigError
from ember.models.transformer import Transformer, rms_norm, softcap

from .ffn_swap import intermediate
from .passes import segments


# ---- step 1: local errors -------------------------------------------------------------------

@dataclass
class LocalCurve:
    """One layer's local error at each candidate sparsity (glu_calibration.py, step 1)."""

    thresholds: list[float]  # per level
    errors: torch.Tensor  # (levels,) mean squared change of the post-normed output
    biases: list[torch.Tensor | None]


def post_ffn(block: nn.Module, f: torch.Tensor) -> torch.Tensor:
    """A block's FFN output as the residual stream adds it (after its post-FFN norm, if any)."""
    if block.cfg.sandwich_norms:
        return rms_norm(f, block.post_ffn_norm, block.cfg.rms_eps)
    return f


@torch.inference_mode()
def local_curve(block: nn.Module, x: torch.Tensor, levels: list[float],
                compensate: bool) -> LocalCurve:
    """For each sparsity in `levels`: the |h| threshold giving it on the inputs x and the mean
    squared change of the block's FFN output when the entries under it are dropped (with
    their mean added back as a bias when `compensate`)."""
    ffn = block.ffn
    h = intermediate(ffn, x)  # (N, ffn)
    habs = h.abs()
    rel = habs / habs.mean(-1, keepdim=True).clamp(min=1e-30)  # what `is_active` compares
    ref = post_ffn(block, h @ ffn.down)
    flat = rel.flatten().sort().values
    taus, errors, biases = [], [], []
    for s in levels:
        tau = float(flat[min(len(flat) - 1, int(s * len(flat)))])
        dropped = h * (rel <= tau)
        bias = dropped.mean(0) @ ffn.down if compensate else None
        out = (h - dropped) @ ffn.down
        if bias is not None:
            out = out + bias
        taus.append(tau)
        errors.append(float((post_ffn(block, out) - ref).pow(2).sum(-1).mean()))
        biases.append(bias)
    return LocalCurve(taus, torch.tensor(errors, dtype=torch.float64), biases)


# ---- step 2-4: running the model from a given layer on, scored on a shortlist -----------------

class KLProbe:
    """Dense reference on the calibration tokens: each block's input and the KV caches, so a
    run that changes layer l alone re-runs only blocks l.. (earlier K/V are unchanged)."""

    @torch.inference_mode()
    def __init__(self, model: Transformer, ids: list[int], bos_id: int | None, length: int,
                 top: int):
        self.model = model
        self.segs = [s.to(model.device) for s in segments(ids, length, bos_id)]
        if not self.segs:
            raise ConfigError("too few calibration tokens to probe (need at least 2)")
        self.caches, self.inputs, finals = [], [], []
        for seg in self.segs:
            cache = model.new_cache(len(seg))
            x = model.embed(seg)
            per_layer = []
            for block in model.blocks:
                per_layer.append(x)
                x = block(x, 0, cache)
            cache.commit(len(seg))
            self.caches.append(cache)
            self.inputs.append(per_layer)
            finals.append(rms_norm(x, model.output_norm, model.cfg.rms_eps)[:-1])
        # Shortlist: every position's dense top-k and its target token.
        cols = [torch.cat([s[1:] for s in self.segs])]
        for final in finals:
            for c in range(0, final.shape[0], 128):
                cols.append(model.logits(final[c: c + 128]).topk(top, dim=-1).indices.flatten())
        self.cols = torch.cat(cols).unique()
        self.targets = torch.searchsorted(self.cols, torch.cat([s[1:] for s in self.segs]))
        self.weight = self._head_columns()
        self.dense_logp = self._logp(torch.cat(finals))
        self.dense_nll = self._nll(self.dense_logp)

    def _head_columns(self) -> torch.Tensor | None:
        weight = getattr(self.model.head, "weight", None)  # (hidden, vocab) once built
        return weight[:, self.cols].contiguous() if isinstance(weight, torch.Tensor) else None

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # a head without a float weight: full logits, then the columns
            logits = torch.cat([self.model.logits(hidden[c: c + 128])[:, self.cols]
                                for c in range(0, hidden.shape[0], 128)])
        else:
            logits = softcap(hidden @ self.weight, self.model.cfg.final_logit_softcap)
        return torch.log_softmax(logits, dim=-1)

    def _nll(self, logp: torch.Tensor) -> float:
        return -float(logp.gather(1, self.targets[:, None]).mean())

    @torch.inference_mode()
    def run(self, first_layer: int) -> tuple[float, float]:
        """(KL(dense || current) nats/token, mean NLL change) re-running blocks first_layer..;
        whatever FFNs are swapped in at the time take effect."""
        model, finals = self.model, []
        for seg, cache, per_layer in zip(self.segs, self.caches, self.inputs):
            x = per_layer[first_layer]
            for block in model.blocks[first_layer:]:
                x = block(x, 0, cache)
            finals.append(rms_norm(x, model.output_norm, model.cfg.rms_eps)[:-1])
        logp = self._logp(torch.cat(finals))
        kl = float((self.dense_logp.exp() * (self.dense_logp - logp)).sum(-1).mean())
        return kl, self._nll(logp) - self.dense_nll
