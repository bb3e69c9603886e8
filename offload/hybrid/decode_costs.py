"""What one decoded token costs in each placement of a layer: the objective of the whole-model
plan (`ember.placement.layer_modes`), for a real file or a paper shape alike.

Decode is memory-bound: a token reads every weight it uses once. Per layer, in the file's
bytes (contract: the tier holds the file's own blocks):

    tier side   bytes / card.read_gbps + kernels x launch   (launch: CUDA-graph replay or eager)
    host side   bytes / host_gbps + HOST_LAYER_MS
    crossing    HANDOFF_MS + hidden state bytes / PCIe link, each time the hidden state
                changes sides; a split layer pays two (to the host and back)

    "gpu"    attention + KV read + whole FFN on the tier
    "split"  attention + KV read on the tier; then max(tier: hot rows, host: cold rows) and
             the round trip (the two sides run at once)
    "cpu"    attention + KV read + FFN on the host

KV is read at half the context (a token sees the mean position). Dense layers read every
cold neuron; with `activity` (per layer, each neuron's probability of firing, a profile's or
a ReLU model's), the host side reads only the cold neurons expected to fire, as a predictor
lets it (PowerInfer's split), after reading its predictor (`LayerBytes.predictor`, on
attention's side). Hot neurons come in steps
of the layer's granule (the down type's block size: whole blocks of its input axis), hottest
first, charged `LayerBytes.hot`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.placement.layer_modes import LayerOption, ModelProblem

from .gpu_cards import GpuCard

# PyTorch issues about 15 kernels a decoder layer (norm, q, k, v, rope, KV write, attention,
# output, residual; norm, gate, up, activation x up, down, residual) at 5-10 us each eagerly;
# replayed from a CUDA graph a kernel costs about 2 us of launch and idle gap.
ATTENTION_KERNELS, FFN_KERNELS, HEAD_KERNELS = 9, 6, 2
EAGER_LAUNCH_MS, GRAPH_LAUNCH_MS = 0.0075, 0.002
HOST_LAYER_MS = 0.005  # a host side's fixed cost per layer (threads woken, joined)
HANDOFF_MS = 0.015  # one copy between host and tier, waited for


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer's bytes as the file stores them."""

    attention: int  # q, k, v, output projections and the layer's norms
    kv: int  # its KV pool on the tier: the whole context at the KV type's width
    kv_read: int  # KV a decoded token reads (half the context, or the window)
    gate_up: int  # per FFN neuron: its gate (if any) and up rows
    down: int  # per FFN neuron: its column of down
    neurons: int
    granule: int  # hot neurons per whole block of down's input axis
    predictor: int = 0  # a sparse layer's predictor (read every token, beside attention)

    @property
    def ffn(self) -> int:
        return self.neurons * (self.gate_up + self.down)

    def hot(self, n: int) -> int:
        """Tier bytes of n hot neurons: their gate/up rows and whole blocks of down."""
        blocks = -(-n // self.granule) * self.granule
        return n * self.gate_up + min(blocks, self.neurons) * self.down


@dataclass(frozen=True)
class ModelBytes:
    layers: tuple[LayerBytes, ...]
    head: int  # the output layer (the final norm, a few KB, is the host's)
    hidden: int  # width of the hidden state that crosses between sides

    def weights_per_token(self) -> int:
        """Weight bytes a token reads (the embedding's one row aside)."""
        return sum(l.attention + l.ffn for l in self.layers) + self.head

    @classmethod
    def of_file(cls, cfg, weights, n_ctx: int, kv_pool: int, kv_layers=None) -> "ModelBytes":
        """From the file's tensors (`WeightStore`): each layer's attention is every tensor
        of its block but the FFN's (norms and biases with it); `kv_pool`, the tier's KV
        pool in bytes, is shared out by the positions each layer holds (a windowed layer
        its window, at most), or as `kv_layers` says (per layer bytes: KVPlan.layer_bytes,
        the blocks the cache gives each layer, so a tier layer is charged what it holds)."""
        from ember.models.quants import block_info

        held = [n_ctx if cfg.window(i) is None else min(n_ctx, cfg.window(i))
                for i in range(cfg.n_layers)]
        row = kv_pool / max(sum(held), 1)  # one position's K and V, one layer
        ffn_names = {f"ffn_{n}.weight" for n in ("gate", "up", "down")}
        layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            names = [n for n in weights.names() if n.startswith(p)]
            attention = sum(weights.get(n).nbytes for n in names
                            if n[len(p):] not in ffn_names)
            gate_up = sum(weights.get(p + f"ffn_{n}.weight").nbytes
                          for n in ("gate", "up") if p + f"ffn_{n}.weight" in weights)
            down = weights.get(p + "ffn_down.weight")
            kv = int(row * held[i]) if kv_layers is None else kv_layers[i]
            layers.append(LayerBytes(attention, kv, int(row * min(held[i], n_ctx // 2)),
                                     gate_up // cfg.ffn_size, down.nbytes // cfg.ffn_size,
                                     cfg.ffn_size, block_info(down.qtype)[0]))
        head = weights.get("token_embd.weight" if cfg.tied_embeddings else "output.weight")
        return cls(tuple(layers), head.nbytes, cfg.hidden_size)


@dataclass(frozen=True)
class DecodeSpeeds:
    tier: GpuCard
    host_gbps: float  # what the host's decode reaches (measured: `ember bench decode`)
    graphs: bool = True  # the decode step replayed from a CUDA graph (else eager launches)

    @property
    def launch_ms(self) -> float:
        return GRAPH_LAUNCH_MS if self.graphs else EAGER_LAUNCH_MS

    @property
    def shared_bus(self) -> bool:
        """The tier is the host's own memory (the cpu profile): no link, one bus."""
        return self.tier.pcie_gen == 0

    def tier_ms(self, nbytes: float, kernels: int) -> float:
        return nbytes / (self.tier.read_gbps * 1e6) + kernels * self.launch_ms

    def host_ms(self, nbytes: float) -> float:
        return nbytes / (self.host_gbps * 1e6) + HOST_LAYER_MS

    def cross_ms(self, hidden: int) -> float:
        return HANDOFF_MS + hidden * 4 / (self.tier.link_gbps * 1e6)

    def to_dict(self) -> dict:
        return {"card": self.tier.to_dict(), "host_gbps": round(self.host_gbps, 2),
                "cuda_graphs": self.graphs, "launch_ms_per_kernel": self.launch_ms,
                "kernels_per_layer": ATTENTION_KERNELS + FFN_KERNELS,
                "host_layer_ms": HOST_LAYER_MS, "handoff_ms": HANDOFF_MS}


def layer_problem(model: ModelBytes, speeds: DecodeSpeeds, budget: int,
                  activity=None, split: str = "auto") -> ModelProblem:
    """The whole-model problem for `budget` tier bytes (workspace already taken off).

    Args:
        activity: per layer (neurons,) firing probabilities (None: dense, every neuron).
        split: "auto" (any mode), "cpu-only" (no FFN neuron on the tier: "split" layers
            with nothing hot, or "cpu"), "gpu-only" (every FFN neuron on the tier: "gpu").
    """
    layers = []
    for i, lb in enumerate(model.layers):
        price = LayerPrice(lb, speeds, speeds.cross_ms(model.hidden),
                           None if activity is None else activity[i])
        layers.append(tuple(price.options(split)))
    return ModelProblem(tuple(layers), model.head, *head_ms(model, speeds),
                        cross_ms=speeds.cross_ms(model.hidden), budget=budget)


def head_ms(model: ModelBytes, speeds: DecodeSpeeds) -> tuple[float, float]:
    """The LM head's ms per token on the tier and on the host."""
    return speeds.tier_ms(model.head, HEAD_KERNELS), speeds.host_ms(model.head)


class LayerPrice:
    """One layer's ms per token in each mode (`activity`: its neurons' firing
    probabilities, None: dense)."""

    def __init__(self, lb: LayerBytes, speeds: DecodeSpeeds, cross: float, activity=None):
        self.lb, self.speeds, self.cross = lb, speeds, cross
        # Expected cold neurons read when the h hottest are hot: prefix sums, hottest first
        self.mass = None if activity is None else np.concatenate(
            ([0.0], np.cumsum(np.sort(np.asarray(activity, float))[::-1])))
        # A layer that skips cold neurons runs its predictor on attention's side first
        self.predictor = 0 if activity is None else lb.predictor

    def cold_read(self, h: int) -> float:
        lb = self.lb
        active = lb.neurons - h if self.mass is None else self.mass[-1] - self.mass[h]
        return active * (lb.gate_up + lb.down)

    def ms(self, mode: str, h: int, hot_bytes: int | None = None) -> float:
        """mode "gpu", "split" or "cpu"; or "rows", the FFN-rows split Ember runs before
        attention can sit on the tier: attention on the host, `hot_bytes` of hot rows
        (their tier format's) on the tier."""
        lb, sp = self.lb, self.speeds
        attention = lb.attention + lb.kv_read
        if mode == "cpu":
            return sp.host_ms(attention + self.predictor + self.cold_read(0))
        if mode == "gpu":
            return sp.tier_ms(attention + lb.ffn, ATTENTION_KERNELS + FFN_KERNELS)
        hot = lb.hot(h) if hot_bytes is None else hot_bytes
        tier = sp.tier_ms(hot, FFN_KERNELS) if h else 0.0
        host = sp.host_ms(self.cold_read(h)) if h < lb.neurons else 0.0
        # one memory bus (the CPU as the tier): both sides' reads add up
        ffn = tier + host if sp.shared_bus else max(tier, host)
        ffn += 2 * self.cross if h < lb.neurons and (h or mode == "split") else 0.0
        if mode == "rows":
            return sp.host_ms(attention + self.predictor) + ffn
        return sp.tier_ms(attention + self.predictor, ATTENTION_KERNELS) + ffn

    def options(self, split: str) -> list[LayerOption]:
        lb = self.lb
        out = []
        if split != "gpu-only":
            out.append(LayerOption("cpu", 0, 0, self.ms("cpu", 0)))
        if split != "cpu-only":
            out.append(LayerOption("gpu", lb.neurons, lb.attention + lb.kv + lb.ffn,
                                   self.ms("gpu", lb.neurons)))
        if split == "gpu-only":
            return out
        for h in range(0, 1 if split == "cpu-only" else lb.neurons, lb.granule):
            out.append(LayerOption("split", h,
                                   lb.attention + lb.kv + self.predictor + lb.hot(h),
                                   self.ms("split", h)))
        return out


def host_weight_bytes(model: ModelBytes, modes, hot, head_on_gpu: bool) -> int:
    """Weight bytes the host reads per token under a plan, dense (every cold neuron)."""
    total = 0 if head_on_gpu else model.head
    for lb, mode, h in zip(model.layers, modes, hot):
        if mode == "cpu":
            total += lb.attention + lb.ffn
        elif mode == "split":
            total += (lb.neurons - h) * (lb.gate_up + lb.down)
    return total
