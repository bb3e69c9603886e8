"""Turn a loaded dense model into a hybrid one: plan the GPU tier, split every FFN layer.

The engine calls `build_hybrid` before moving anything to a device: FFN layers are sliced on
the host straight into their homes (hot rows to the GPU tier, cold rows stay in host RAM),
then attention and norms go to the tier the plan chose. The dense FFN modules are kept on
the host (not on any device) so another engine can split the same loaded model differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.transformer import FeedForward, Transformer

from .cpu_worker import CpuWorker
from .hybrid_ffn import HybridFFN, Selector
from .memory_plan import ComponentBytes, MemoryPlan, plan_memory

COLD_DTYPES = ("fp32", "int8")


@dataclass
class HybridModel:
    plan: MemoryPlan
    layers: list[HybridFFN]
    worker: CpuWorker
    gpu: torch.device  # the GPU tier's device (the CPU when there is no GPU)

    @property
    def attention_device(self) -> torch.device:
        return self.gpu if self.plan.attention_on_gpu else torch.device("cpu")

    def reset_counters(self) -> None:
        for layer in self.layers:
            layer.counters.reset()

    def report(self) -> dict:
        """The plan plus what the layers computed since the last reset."""
        computed = [layer.computed_fraction() for layer in self.layers]
        known = [c for c in computed if c is not None]
        return {
            **self.plan.to_dict(),
            "gpu_tier_device": str(self.gpu),
            "gpu_ffn_bytes": sum(layer.gpu_bytes() for layer in self.layers),
            "host_ffn_bytes": sum(layer.host_bytes() for layer in self.layers),
            "computed_fraction_per_layer": [None if c is None else round(c, 4) for c in computed],
            "sparsity": None if not known else round(1 - sum(known) / len(known), 4),
        }

    def close(self) -> None:
        self.worker.close()


def dense_ffn_of(block) -> FeedForward:
    """The block's dense FFN, also when an earlier engine split it."""
    ffn = block.ffn
    if isinstance(ffn, HybridFFN):
        if ffn.source is None:
            raise RuntimeError("this model's FFN was split without keeping its dense weights")
        return ffn.source
    return ffn


def component_bytes(model: Transformer, kv_pool: int, lm_head: int,
                    predictors: int = 0) -> ComponentBytes:
    return ComponentBytes.estimate(model.cfg, kv_pool, lm_head, predictors)


def build_hybrid(model: Transformer, budget: int, gpu: torch.device, kv_pool_bytes: int,
                 split: str = "auto", cold_dtype: str = "fp32", preferred=None,
                 neuron_order=None, selectors: list[Selector | None] | None = None,
                 predictor_bytes: int = 0) -> HybridModel:
    """Plan `budget` bytes of GPU tier and split the model's FFN layers accordingly.

    The LM head is charged at fp32 (what a GPU tier would hold)."""
    if cold_dtype not in COLD_DTYPES:
        from ember.models.errors import ConfigError

        raise ConfigError(f"unknown cold weight type {cold_dtype!r}; choose one of "
                          f"{', '.join(COLD_DTYPES)}")
    restore_dense(model)
    cfg = model.cfg
    head = cfg.vocab_size * cfg.hidden_size * 4
    plan = plan_memory(cfg, budget, component_bytes(model, kv_pool_bytes, head, predictor_bytes),
                       split, preferred, neuron_order)
    worker = CpuWorker()
    layers = []
    for i, block in enumerate(model.blocks):
        dense = dense_ffn_of(block)
        hybrid = HybridFFN.split(dense, i, plan.placement.hot[i], gpu, worker, cold_dtype,
                                 None if selectors is None else selectors[i])
        # A plain attribute, not a submodule: `.to(device)` never moves the dense copy.
        object.__setattr__(hybrid, "source", dense)
        block.ffn = hybrid
        layers.append(hybrid)
    return HybridModel(plan, layers, worker, gpu)


class HostLMHead(torch.nn.Module):
    """Keeps an LM head in host RAM when attention runs on a GPU the plan left it off."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: `.to()` must not move it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden.cpu()).to(hidden.device)


def restore_dense(model: Transformer) -> None:
    """Undo an earlier engine's split: dense FFN modules and the plain LM head back."""
    if isinstance(model.head, HostLMHead):
        model.head = model.head.inner
    for block in model.blocks:
        block.ffn = dense_ffn_of(block)
