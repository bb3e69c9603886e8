"""The whole-model plan of a real file: per layer "gpu", "split" or "cpu" and the LM head,
every tier tensor in the file's own bytes (`ComponentBytes.of_file_blocks`), chosen by the
ILP (`ember.placement.layer_modes`) on the forecast's cost model (decode_costs.py) for the
card the plan is made for (`plan_speeds`). `plan_memory` turns the answer into a MemoryPlan;
file_plan.py makes it for a real file (the engine and `ember info` alike). This module also
prices a plan (`plan_forecast`) and describes one (`layer_lines`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ember.models.support.errors import ConfigError
from ember.models.support.sizes import format_size
from ember.placement.layer_modes import ModelPlan, crossings
from ember.placement.layer_modes_ilp import solve_layers

from .decode_costs import (DecodeSpeeds, LayerPrice, ModelBytes, head_ms, host_weight_bytes,
                           layer_problem)
from .gpu_cards import CARDS, GpuCard, card_for_budget
from .paper_shapes import measured_host_gbps

if TYPE_CHECKING:
    from .memory_plan import MemoryPlan


def plan_speeds(budget: int, card: GpuCard | None = None, device=None) -> DecodeSpeeds:
    """The card a plan is priced for: `card` (`--gpu NAME`: a named card wins, so a plan
    for another card can be made anywhere), else a CUDA device's own properties, else the
    table's first card with `budget` bytes (the fastest card's figures, at that size, past
    the table); the host at Ember's measured decode rate."""
    if card is None and device is not None and getattr(device, "type", None) == "cuda":
        import torch

        from .gpu_cards import device_card

        card = device_card(torch.cuda.get_device_properties(device))
    if card is None:
        try:
            card = card_for_budget(budget)
        except ConfigError:
            fastest = max(CARDS.values(), key=lambda c: c.gbps)
            card = replace(fastest, name=f"{fastest.name} (at {format_size(budget)})",
                           memory=budget)
    return DecodeSpeeds(card, measured_host_gbps("ember"))


def solve_modes(model: ModelBytes, room: int, speeds: DecodeSpeeds, split: str,
                activity=None) -> ModelPlan:
    """The plan for `room` tier bytes; `split` "gpu-only" that cannot hold every layer
    whole is the user's error."""
    need = sum(l.attention + l.kv + l.ffn for l in model.layers)
    if split == "gpu-only" and need > room:
        raise ConfigError(f"--split gpu-only needs every layer on the GPU tier: "
                          f"{format_size(need)} beside the working space, but "
                          f"{format_size(max(room, 0))} is left of --gpu-budget")
    return solve_layers(layer_problem(model, speeds, room, activity, split))


def plan_forecast(model: ModelBytes, speeds: DecodeSpeeds, modes, hot, head_on_gpu: bool,
                  activity=None) -> float:
    """ms per token of a plan (modes "gpu", "split", "cpu"), as the ILP prices it."""
    cross = speeds.cross_ms(model.hidden)
    ms = sum(LayerPrice(lb, speeds, cross, None if activity is None else activity[i])
             .ms(m, h) for i, (lb, m, h) in enumerate(zip(model.layers, modes, hot)))
    ms += head_ms(model, speeds)[0 if head_on_gpu else 1]
    return ms + cross * crossings([m != "cpu" for m in modes], head_on_gpu)


def forecast_entry(model: ModelBytes, speeds: DecodeSpeeds, plan: ModelPlan) -> dict:
    """What the plan's objective predicts, on which card, with graphs and eagerly."""
    hot = [o.hot for o in plan.choice]
    eager = plan_forecast(model, replace(speeds, graphs=False), plan.modes, hot,
                          plan.head_on_gpu)
    return {"ms_per_token": round(plan.ms, 3), "eager_ms_per_token": round(eager, 3),
            "cuda_graphs_assumed": speeds.graphs, "solver": plan.status,
            "solve_s": round(plan.solve_s, 3),
            "host_weight_bytes_per_token": host_weight_bytes(model, plan.modes, hot,
                                                             plan.head_on_gpu),
            **speeds.to_dict()}


def _runs(modes) -> str:
    """"0-29 gpu, 30-31 cpu": the modes as runs of layers."""
    out, start = [], 0
    for i in range(1, len(modes) + 1):
        if i == len(modes) or modes[i] != modes[start]:
            out.append(f"{start}-{i - 1} {modes[start]}" if i - 1 > start
                       else f"{start} {modes[start]}")
            start = i
    return ", ".join(out)


def layer_lines(plan: "MemoryPlan") -> list[str]:
    """`describe`'s lines for a whole-model plan: where each part sits, what the host reads."""
    modes, f = plan.layer_modes, plan.forecast or {}
    card = f.get("card", {})
    n = len(modes)
    on_tier = [i for i, m in enumerate(modes) if m != "cpu"]
    counts = {m: modes.count(m) for m in ("gpu", "split", "cpu")}
    lines = [f"  layers      {_runs(modes)}  ({counts['gpu']} whole on the tier, "
             f"{counts['split']} split, {counts['cpu']} on the host)",
             f"  attention   {len(on_tier)} of {n} layers on the tier, in the file's blocks",
             f"  KV pool     {len(on_tier)} of {n} layers on the tier, float16",
             f"  FFN         {counts['gpu']} layers whole on the tier"
             + (f", {counts['split']} split (hot rows on the tier, cold on the host)"
                if counts["split"] else ""),
             f"  output      {'on the tier' if plan.lm_head_on_gpu else 'on the host'}",
             f"  host weight bytes per token: {format_size(plan.host_weight_bytes())}"
             + (" (the embedding's one row aside)" if not plan.host_weight_bytes() else "")]
    if f:
        link = (f"PCIe {card['pcie_gen']}.0 x{card['pcie_lanes']}" if card["pcie_gen"]
                else "no link")
        lines.append(f"  forecast    {f['ms_per_token']:.1f} ms/token on {card['name']} "
                     f"({card['gbps']:.0f} GB/s, {link}; host {f['host_gbps']:.0f} GB/s), "
                     f"decode step replayed from a CUDA graph ({f['eager_ms_per_token']:.1f} "
                     "launched eagerly)")
    return lines
