"""What fits, before anything is downloaded: Ember's neuron split against llama.cpp-style
whole-layer offload (`-ngl`) at one GPU budget, for a paper shape and a quant mix.

Both are priced by one bandwidth model (decode is memory-bound: a token reads every weight
it uses once):

    GPU side   bytes / GPU_GBPS + GPU_BASE_MS per layer that has GPU work
    CPU side   bytes / CPU_GBPS + CPU_BASE_MS
    boundary   SYNC_MS each time activations cross PCIe and a side waits for the other

Whole-layer offload: the first k layers (their file bytes, their KV cache in f16 at `ctx`
tokens) and, once every layer fits, the LM head on the GPU; the rest on the CPU. A token
costs k GPU layers + (L - k) CPU layers + one crossing.

Ember as it runs today: attention, its KV and the LM head on the host's file blocks; per
layer, hot FFN neurons on the GPU in their tier formats (offload/hybrid/tier_dtypes.py, for an sm80
GPU: int4 for Q4-family rows, int8 for Q6_K) and cold ones on CPU threads in int8 bundles,
both sides at once (the max), one crossing per layer. Two figures: every cold neuron
computed (a SwiGLU model without predictors) with the same hot count in every layer, and
sparse decoding under synthetic power-law activation frequencies (the ILP bench's), placed by
the greedy solver on the same cost model (`ember.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember.kernels.hot_ffn import hot_ffn_bytes
from ember.models.errors import ConfigError

from .memory_plan import cold_neuron_bytes, neuron_bytes
from .tier_dtypes import TierCaps, TierChoice

GPU_GBPS, CPU_GBPS = 900.0, 30.0  # a desktop GPU (RTX 3090/4090 class); dual-channel DDR5
GPU_BASE_MS, CPU_BASE_MS, SYNC_MS = 0.010, 0.005, 0.030
WORKSPACE = 256 << 20  # compute buffers either runtime keeps on the GPU
QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "F16")
SM80 = TierCaps(int4=True, half=torch.bfloat16)  # the GPU the forecast assumes


@dataclass(frozen=True)
class PaperShape:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 32000

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)


SHAPES = {s.name: s for s in (
    PaperShape("llama2-7b", 32, 4096, 11008, 32, 32),
    PaperShape("llama2-13b", 40, 5120, 13824, 40, 40),
    PaperShape("llama2-70b", 80, 8192, 28672, 64, 8),
)}

# (elements, bytes) per block of each GGML type used below
_BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q4_0": (32, 18), "Q8_0": (32, 34),
          "F16": (1, 2)}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's Q4_K_M pick of layers whose attn_v / ffn_down get Q6_K."""
    first, last = n_layers // 8, 7 * n_layers // 8
    return layer < first or layer >= last or (layer - first) % 3 == 2


def tensor_type(quant: str, tensor: str, layer: int, n_layers: int) -> str:
    """GGML type of `tensor` ("attn_q", ..., "ffn_down", "output") in a `quant` file."""
    if quant == "Q4_K_M":
        if tensor == "output" or (tensor in ("attn_v", "ffn_down") and more_bits(layer, n_layers)):
            return "Q6_K"
        return "Q4_K"
    if quant == "Q4_0" and tensor == "output":
        return "Q6_K"
    return quant


def nbytes(qtype: str, elements: int) -> int:
    per, size = _BLOCK[qtype]
    return elements // per * size


def _layer_bytes(s: PaperShape, quant: str, i: int) -> tuple[int, int]:
    """(attention, FFN) file bytes of layer i."""
    h, kv, L = s.hidden, s.kv_dim, s.layers
    attn = sum(nbytes(tensor_type(quant, t, i, L), h * n)
               for t, n in (("attn_q", h), ("attn_k", kv), ("attn_v", kv), ("attn_output", h)))
    ffn = sum(nbytes(tensor_type(quant, t, i, L), h * s.ffn)
              for t in ("ffn_gate", "ffn_up", "ffn_down"))
    return attn, ffn


def _kv_bytes(s: PaperShape, tokens: int) -> int:
    return 2 * s.kv_dim * tokens * 2  # K and V, f16, one layer


def whole_layer(s: PaperShape, quant: str, budget: int, ctx: int) -> dict:
    """llama.cpp-style `-ngl k`: as many whole layers (and their KV) as fit, then the head."""
    room = budget - WORKSPACE
    layers = [sum(_layer_bytes(s, quant, i)) for i in range(s.layers)]
    head = nbytes(tensor_type(quant, "output", 0, s.layers), s.vocab * s.hidden)
    k, used = 0, 0
    while k < s.layers and used + layers[k] + _kv_bytes(s, ctx) <= room:
        used += layers[k] + _kv_bytes(s, ctx)
        k += 1
    head_on_gpu = k == s.layers and used + head <= room
    used += head if head_on_gpu else 0
    read = _kv_bytes(s, ctx // 2)  # per layer per token, at the mean position of a context
    ms = sum(_ms(layers[i] + read, i < k) for i in range(s.layers)) + _ms(head, head_on_gpu)
    ms += SYNC_MS if 0 < k < s.layers or (k == s.layers and not head_on_gpu) else 0.0
    return {"gpu_layers": k, "lm_head_on_gpu": head_on_gpu, "gpu_bytes": used + WORKSPACE,
            "ffn_parameters_on_gpu": 3 * s.hidden * s.ffn * k, "ms_per_token": round(ms, 3)}


def _ms(n_bytes: float, gpu: bool) -> float:
    if gpu:
        return n_bytes / (GPU_GBPS * 1e6) + GPU_BASE_MS
    return n_bytes / (CPU_GBPS * 1e6) + CPU_BASE_MS


def ember_split(s: PaperShape, quant: str, budget: int, ctx: int, seed: int = 0) -> dict:
    """Ember's plan and predicted ms/token: attention on the host, FFN split per layer."""
    if budget <= WORKSPACE:
        raise ConfigError(f"--gpu-budget must exceed the {WORKSPACE >> 20} MiB working space")
    tier = TierChoice("auto", SM80)
    formats = [tier.formats([tensor_type(quant, t, i, s.layers) for t in ("ffn_gate", "ffn_up")],
                            tensor_type(quant, "ffn_down", i, s.layers))
               for i in range(s.layers)]
    room = budget - WORKSPACE
    n = _uniform_hot(s, formats, room)
    host = _host_ms(s, quant, ctx)
    hot_b = [hot_ffn_bytes(n, s.hidden, True, f) for f in formats]
    cold_per = cold_neuron_bytes(s.hidden, True, "int8")
    dense = host + sum(_ffn_layer_ms(b, (s.ffn - n) * cold_per, n, s.ffn) for b in hot_b)
    sparse, sparse_hot, mean_act = _sparse_ms(s, formats, room, cold_per, seed)
    counts: dict[str, dict[str, int]] = {"gate_up": {}, "down": {}}
    for gu, dn in formats:
        counts["gate_up"][gu] = counts["gate_up"].get(gu, 0) + 1
        counts["down"][dn] = counts["down"].get(dn, 0) + 1
    return {"tier_formats": counts, "hot_neurons_per_layer": n,
            "hot_fraction": round(n / s.ffn, 4), "gpu_bytes": sum(hot_b) + WORKSPACE,
            "ffn_parameters_on_gpu": 3 * s.hidden * n * s.layers,
            "dense_ms_per_token": round(dense, 3),
            "sparse_ms_per_token": round(host + sparse, 3),
            "sparse_hot_fraction": round(sparse_hot, 4), "mean_activation": round(mean_act, 4)}


def _uniform_hot(s: PaperShape, formats, room: int) -> int:
    """The largest per-layer hot count (whole int4 groups) whose exact bytes fit `room`."""
    lo, hi = 0, s.ffn
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(hot_ffn_bytes(mid, s.hidden, True, f) for f in formats) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo if lo == s.ffn else lo - lo % 32


def _host_ms(s: PaperShape, quant: str, ctx: int) -> float:
    """Attention (file blocks, KV at the mean position) and the LM head on the CPU."""
    attn = sum(_layer_bytes(s, quant, i)[0] + _kv_bytes(s, ctx // 2) for i in range(s.layers))
    head = nbytes(tensor_type(quant, "output", 0, s.layers), s.vocab * s.hidden)
    return _ms(attn + head, False) + s.layers * CPU_BASE_MS


def _ffn_layer_ms(hot_bytes: int, cold_bytes: int, hot: int, total: int) -> float:
    gpu = _ms(hot_bytes, True) if hot else 0.0
    cpu = _ms(cold_bytes, False) if hot < total else 0.0
    return max(gpu, cpu) + (SYNC_MS if hot else 0.0)


def _sparse_ms(s: PaperShape, formats, room: int, cold_per: int, seed: int):
    """The greedy placement's FFN ms/token under synthetic activation frequencies."""
    from ember.placement import PlacementProblem, default_group_size, solve

    freqs = synthetic_frequencies(s.layers, s.ffn, seed)
    per = [neuron_bytes(s.hidden, True, f) for f in formats]
    problem = PlacementProblem(
        freqs=freqs, neuron_bytes=per,
        gpu_ms_per_neuron=[b / (GPU_GBPS * 1e6) for b in per],
        cpu_ms_per_active=cold_per / (CPU_GBPS * 1e6), budget_bytes=room * 0.99,
        gpu_base_ms=GPU_BASE_MS, cpu_base_ms=CPU_BASE_MS, split_ms=SYNC_MS, min_hot=32,
        group_size=default_group_size([s.ffn] * s.layers))
    result = solve(problem, "greedy")
    return (result.objective_ms, result.placement.total_hot_fraction(),
            float(np.mean([f.mean() for f in freqs])))


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


def forecast(shape: str, quant: str, budget: int, ctx: int = 4096, seed: int = 0) -> dict:
    """Both plans side by side (the JSON `ember bench placement --shape` prints)."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ConfigError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    s = SHAPES[shape]
    ember = ember_split(s, quant, budget, ctx, seed)
    layer = whole_layer(s, quant, budget, ctx)
    return {
        "shape": {**s.__dict__, "quant": quant, "ctx": ctx,
                  "file_bytes": sum(sum(_layer_bytes(s, quant, i)) for i in range(s.layers))},
        "gpu_budget_bytes": budget,
        "assumptions": {"gpu_gbps": GPU_GBPS, "cpu_gbps": CPU_GBPS, "gpu_base_ms": GPU_BASE_MS,
                        "cpu_base_ms": CPU_BASE_MS, "sync_ms": SYNC_MS,
                        "workspace_bytes": WORKSPACE, "kv_read_at_tokens": ctx // 2,
                        "tier_device": "CUDA sm80+ (int4 tiles)"},
        "ember_split": ember,
        "whole_layer_offload": layer,
        "dense_speedup_over_whole_layer": round(layer["ms_per_token"]
                                                / ember["dense_ms_per_token"], 3),
        "sparse_speedup_over_whole_layer": round(layer["ms_per_token"]
                                                 / ember["sparse_ms_per_token"], 3),
    }
