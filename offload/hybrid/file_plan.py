"""The GPU-tier plan of a real file under `--gpu-budget`: the one call the engine
(offload/runtime/engine_model.py) and `ember info --gpu-budget` both make, so what info shows
is what the engine builds.
"""

from __future__ import annotations

from .component_bytes import ComponentBytes
from .gpu_cards import card, check_budget
from .layer_plan import plan_speeds
from .memory_plan import MemoryPlan, plan_memory


def plans_whole_model(tier_attention: str, tier_dtype: str) -> bool:
    """Whether flags ask for the whole-model plan (every tensor in the file's bytes):
    `--tier-attention auto` with the file's formats. A named format keeps the plan of FFN
    rows, attention moving whole (memory_plan.py)."""
    return tier_attention == "auto" and tier_dtype in ("auto", "file")


def plan_file(cfg, weights, budget: int, n_ctx: int, kv_pool: int, split: str = "auto",
              gpu: str | None = None, device=None, order=None, activity=None,
              kv_layers=None) -> MemoryPlan:
    """The whole-model plan of a file for `budget` tier bytes and a KV pool of `kv_pool`
    bytes, priced for the card `gpu` names, else a CUDA `device`'s own properties, else the
    table's first card with the budget's memory (`layer_plan.plan_speeds`). `order`: per
    layer, neurons hottest first (a profile's); `activity`: their firing probabilities where
    a predictor lets the host skip cold ones. `kv_layers`: each layer's share of `kv_pool`
    (KVPlan.layer_bytes: the blocks the cache gives it), charged to a tier layer."""
    speeds = plan_speeds(budget, card(gpu) if gpu else None, device)
    check_budget(speeds.tier, budget)
    sizes = ComponentBytes.of_file_blocks(cfg, weights, n_ctx, kv_pool, kv_layers)
    return plan_memory(cfg, budget, sizes, split, neuron_order=order, speeds=speeds,
                       activity=activity)
