"""The rival, fixed first: llama.cpp's whole-layer offload (`-ngl k`) on a named card.

Its own constants and nothing of Ember's plan, so that a change to Ember's planner or its
cost model cannot move this line (tests/test_forecast.py pins its figures):

- llama.cpp offloads the last k layers (their weights and their f16 KV) and, once every
  layer is there, the output layer; the token embedding stays on the host.
- The GPU reads at the card's documented bandwidth times `gpu_cards.ACHIEVED` and replays
  its decode graph with CUDA graphs: `KERNELS_PER_LAYER` nodes at `GRAPH_LAUNCH_MS` each.
- The host reads at the rate `ember bench decode --against llama.cpp` measured for
  llama.cpp on this machine's CPU (paper_shapes.measured_host_gbps).
- Each change of side (the embedding row up, the hidden state at the split point, the
  logits back) costs a copy and a wait; llama.cpp reserves a compute buffer on the GPU.
"""

from __future__ import annotations

from .gpu_cards import GpuCard
from .paper_shapes import (PaperShape, head_bytes, kv_bytes, layer_file_bytes,
                           measured_host_gbps)

KERNELS_PER_LAYER = 15  # graph nodes of one decoder layer at batch 1
GRAPH_LAUNCH_MS = 0.002
HOST_LAYER_MS = 0.005
HANDOFF_MS = 0.015
COMPUTE_BUFFER = 256 << 20  # llama.cpp's CUDA compute buffer at a 4k context, about


def llama_cpp_offload(s: PaperShape, quant: str, card: GpuCard, budget: int,
                      ctx: int) -> dict:
    """`-ngl k` with the largest k whose layers and KV fit `budget`, and its ms/token."""
    host_gbps = measured_host_gbps("llama.cpp")
    room = budget - COMPUTE_BUFFER
    layers = [sum(layer_file_bytes(s, quant, i)) for i in range(s.layers)]
    head = head_bytes(s, quant)
    k, used = 0, 0
    for i in reversed(range(s.layers)):  # the last layers go first
        if used + layers[i] + kv_bytes(s, ctx) > room:
            break
        used += layers[i] + kv_bytes(s, ctx)
        k += 1
    head_on_gpu = k == s.layers and used + head <= room
    used += head if head_on_gpu else 0
    read = kv_bytes(s, ctx // 2)  # per layer per token: the mean position of a context
    gpu_gbps = card.read_gbps

    def ms(n_bytes: float, gpu: bool, kernels: int) -> float:
        if gpu:
            return n_bytes / (gpu_gbps * 1e6) + kernels * GRAPH_LAUNCH_MS
        return n_bytes / (host_gbps * 1e6) + HOST_LAYER_MS

    first_gpu = s.layers - k
    total = sum(ms(layers[i] + read, i >= first_gpu, KERNELS_PER_LAYER)
                for i in range(s.layers))
    total += ms(head, head_on_gpu, 2)
    # host -> first GPU layer, and back after the last layer or the head
    crossings = 0 if k == 0 else 2
    total += crossings * (HANDOFF_MS + s.hidden * 4 / (card.link_gbps * 1e6))
    return {"gpu_layers": k, "lm_head_on_gpu": head_on_gpu, "gpu_bytes": used + COMPUTE_BUFFER,
            "ffn_parameters_on_gpu": 3 * s.hidden * s.ffn * k, "host_gbps": round(host_gbps, 2),
            "ms_per_token": round(total, 3)}
