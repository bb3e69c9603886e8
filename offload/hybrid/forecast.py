"""What fits, before anything is downloaded: Ember's whole-model plan against llama.cpp's
whole-layer offload (`-ngl`) on a named card, for a paper shape and a quant mix.

The rival's line comes first and stands alone (offload/hybrid/llama_offload.py): its
figures do not move when Ember's planner does. Ember's plan is the one `plan_memory` makes
for a real file: per layer "gpu", "split" or "cpu" and the LM head, chosen by the ILP
(`ember.placement.layer_modes`) on the cost model of offload/hybrid/decode_costs.py, every
tier tensor in the file's bytes. Two figures: dense (every FFN neuron computed, a SwiGLU
model) and sparse (a predictor skips cold neurons that do not fire, under synthetic ReLU-level
power-law activation frequencies). Ember's decode step is assumed replayed from a CUDA graph
(`cuda_graphs` in the report); the eager figure is given beside it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ember.models.support.errors import ConfigError
from ember.placement.layer_modes import solve_greedy
from ember.placement.layer_modes_ilp import solve_layers

from .component_bytes import graph_bytes
from .decode_costs import DecodeSpeeds, host_weight_bytes, layer_problem
from .gpu_cards import GpuCard, card_for_budget, check_budget
from .llama_offload import llama_cpp_offload
from .paper_shapes import QUANTS, SHAPES, PaperShape, measured_host_gbps, model_bytes

PREFILL_CHUNK = 512  # Ember's prefill chunk: its working space on the tier
PREDICTOR_RANK = 256  # the widest predictor `ember profile` trains (predictors/train.py)


def workspace(s: PaperShape, context: int = 4096) -> int:
    """Activations of one prefill chunk through one layer and the decode step's CUDA graph
    (memory_plan.workspace_bytes)."""
    width = max(2 * s.hidden + 2 * s.ffn, s.hidden + 2 * s.kv_dim + s.hidden)
    return PREFILL_CHUNK * width * 4 + graph_bytes(s.layers, s.hidden, s.ffn, s.hidden,
                                                   s.kv_dim, context)


def ember_plan(s: PaperShape, quant: str, card: GpuCard, budget: int, ctx: int,
               activity=None, graphs: bool = True, host: str = "ember") -> dict:
    """Ember's plan on `card` with `budget` bytes, and its predicted ms/token; `activity`:
    sparse layers (each with a predictor, float16 at `PREDICTOR_RANK`); `host`: whose
    measured host rate prices the host side."""
    room = budget - workspace(s)
    if room <= 0:
        raise ConfigError(f"--gpu-budget must exceed the {workspace(s) >> 20} MiB working space")
    model = model_bytes(s, quant, ctx)
    if activity is not None:
        per = (s.hidden + s.ffn) * PREDICTOR_RANK * 2
        model = replace(model, layers=tuple(replace(l, predictor=per) for l in model.layers))
    speeds = DecodeSpeeds(card, measured_host_gbps(host), graphs)
    problem = layer_problem(model, speeds, room, activity)
    plan = solve_layers(problem)
    hot = [o.hot for o in plan.choice]
    return {"layer_modes": plan.counts(), "lm_head_on_gpu": plan.head_on_gpu,
            "gpu_bytes": plan.nbytes + workspace(s),
            "hot_fraction": round(sum(hot) / (s.ffn * s.layers), 4),
            "host_weight_bytes_per_token": host_weight_bytes(model, plan.modes, hot,
                                                             plan.head_on_gpu),
            "ms_per_token": round(plan.ms, 3),
            "greedy_ms_per_token": round(solve_greedy(problem).ms, 3),
            "solver": plan.status, "solve_s": round(plan.solve_s, 3)}


def synthetic_frequencies(layers: int, ffn: int, seed: int = 0) -> list[np.ndarray]:
    """Per layer (ffn,) activation probabilities: a power law whose steepness varies with
    depth (ReLU models' profiles look so), shuffled so hot neurons are not a prefix."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in range(layers):
        depth = layer / max(layers - 1, 1)
        alpha = 0.55 + 0.6 * abs(np.sin(3.0 * depth)) + rng.uniform(-0.05, 0.05)
        knee = rng.uniform(50, 500)
        ranked = 0.95 * ((np.arange(ffn) + knee) / knee) ** -alpha
        ranked *= rng.uniform(0.9, 1.1, ffn)
        out.append(rng.permutation(np.clip(ranked, 0.0, 1.0)))
    return out


def forecast(shape: str, quant: str, budget: int, ctx: int = 4096, seed: int = 0,
             card: GpuCard | None = None) -> dict:
    """Both plans side by side (the JSON `ember bench placement --shape` prints); `card`
    None: the first card of the table with `budget` bytes of memory."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ConfigError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    s = SHAPES[shape]
    card = card or card_for_budget(budget)
    check_budget(card, budget)
    rival = llama_cpp_offload(s, quant, card, budget, ctx)
    dense = ember_plan(s, quant, card, budget, ctx)
    eager = ember_plan(s, quant, card, budget, ctx, graphs=False)
    # The plan's own gain: Ember's host side at llama.cpp's measured rate
    same_host = ember_plan(s, quant, card, budget, ctx, host="llama.cpp")
    freqs = synthetic_frequencies(s.layers, s.ffn, seed)
    sparse = ember_plan(s, quant, card, budget, ctx, activity=freqs)
    model = model_bytes(s, quant, ctx)
    fits = (sum(l.attention + l.kv + l.ffn for l in model.layers) + model.head
            <= budget - workspace(s))
    speeds = DecodeSpeeds(card, measured_host_gbps("ember"))
    return {
        "shape": {**s.__dict__, "quant": quant, "ctx": ctx,
                  "weight_bytes_per_token": model.weights_per_token()},
        "gpu_budget_bytes": budget,
        "card": card.to_dict(),
        "assumptions": {**speeds.to_dict(), "ember_workspace_bytes": workspace(s),
                        "kv_read_at_tokens": ctx // 2, "tier_formats": "the file's blocks",
                        "ember_cuda_graphs": "assumed (decode step replayed from a CUDA "
                                             "graph); eager launches priced beside it"},
        "model_and_kv_fit": fits,
        "ember_plan": dense,
        "ember_plan_eager_ms_per_token": eager["ms_per_token"],
        "ember_sparse_plan": {**sparse, "mean_activation":
                              round(float(np.mean([f.mean() for f in freqs])), 4)},
        "whole_layer_offload": rival,
        "dense_speedup_over_whole_layer": round(rival["ms_per_token"] / dense["ms_per_token"], 3),
        "eager_speedup_over_whole_layer": round(rival["ms_per_token"] / eager["ms_per_token"], 3),
        "same_host_speedup_over_whole_layer": round(rival["ms_per_token"]
                                                    / same_host["ms_per_token"], 3),
        "sparse_speedup_over_whole_layer": round(rival["ms_per_token"]
                                                 / sparse["ms_per_token"], 3),
    }
