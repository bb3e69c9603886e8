"""One placement for the whole model: per decoder layer one of three modes, and the LM head.

    "gpu"    attention (and its KV) and the whole FFN on the tier
    "split"  attention (and its KV) on the tier, the FFN's hot neurons on the tier, cold on the host
    "cpu"    the whole layer and its KV on the host

The caller prices each layer's options (`LayerOption`: tier bytes, ms per token) and the head
on either side; this module chooses. Besides the options' own times, a token pays `cross_ms`
each time the hidden state changes sides along the chain

    host (embedding row) -> layer 0 -> ... -> layer L-1 -> LM head -> host (sampling)

where a layer's side is its attention's ("gpu" and "split" layers are on the tier; a split
layer's own round trip to the host is inside its option's time). Exactly:

    minimize    sum_{l,o} ms[l,o] x[l,o] + head_gpu_ms h + head_cpu_ms (1 - h) + cross_ms sum_j c_j
    subject to  sum_o x[l,o] = 1                      one option per layer
                sum_{l,o} bytes[l,o] x[l,o] + head_bytes h <= budget
                c_j >= n_j - n_{j-1},  c_j >= n_{j-1} - n_j   over the chain's sides n
                (n_0 = 0, n_l = sum of layer l's tier-side x, n_{L+1} = h, n_{L+2} = 0)

Options a layer would never take are pruned first: on the tier side, one with more bytes and
no less time than another. (The host side has one option, and a tier option slower than it
may still pay by sparing two crossings, so the two sides are never compared.) The solvers:
the ILP (layer_modes_ilp.py), a chain DP on a priced budget (layer_modes_dp.py) that the ILP
starts from, and the greedy baseline here (llama.cpp's order: whole layers from the last).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

MODES = ("gpu", "split", "cpu")


@dataclass(frozen=True)
class LayerOption:
    mode: str  # one of MODES
    hot: int  # FFN neurons on the tier (all for "gpu", none for "cpu")
    nbytes: int  # tier bytes: attention + KV + hot FFN rows
    ms: float  # the layer's time per token in this mode, its split's own round trip included

    @property
    def on_tier(self) -> bool:
        return self.mode != "cpu"


@dataclass(frozen=True)
class ModelProblem:
    layers: tuple[tuple[LayerOption, ...], ...]  # per layer, the options it may take
    head_bytes: int
    head_gpu_ms: float
    head_cpu_ms: float
    cross_ms: float  # one hand-over of the hidden state between host and tier
    budget: int  # tier bytes these parts may take


@dataclass(frozen=True)
class ModelPlan:
    choice: tuple[LayerOption, ...]
    head_on_gpu: bool
    ms: float  # `total_ms` of the choice
    nbytes: int
    status: str  # "fits" (the whole model), "optimal", "time_limit", "fallback" (the DP's
    # or the greedy plan: CBC found nothing better) or "greedy"
    solve_s: float = 0.0

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(o.mode for o in self.choice)

    def counts(self) -> dict[str, int]:
        return {m: self.modes.count(m) for m in MODES}


def crossings(sides: list[bool], head_on_gpu: bool) -> int:
    """Side changes along host -> layers -> head -> host."""
    chain = [False, *sides, head_on_gpu, False]
    return sum(a != b for a, b in zip(chain, chain[1:]))


def total_ms(problem: ModelProblem, choice, head_on_gpu: bool) -> float:
    """The objective of a choice, exactly (what every solver is scored on)."""
    ms = sum(o.ms for o in choice)
    ms += problem.head_gpu_ms if head_on_gpu else problem.head_cpu_ms
    return ms + problem.cross_ms * crossings([o.on_tier for o in choice], head_on_gpu)


def tier_bytes(problem: ModelProblem, choice, head_on_gpu: bool) -> int:
    return sum(o.nbytes for o in choice) + (problem.head_bytes if head_on_gpu else 0)


def pruned(options, budget: int) -> list[LayerOption]:
    """A layer's options worth choosing from: within the budget, and on the tier side none
    with more bytes and no less time than another tier option."""
    host = [o for o in options if not o.on_tier]
    tier, best = [], float("inf")
    for o in sorted((o for o in options if o.on_tier and o.nbytes <= budget),
                    key=lambda o: (o.nbytes, o.ms)):
        if o.ms < best:
            tier.append(o)
            best = o.ms
    return host + tier


def whole_model(problem: ModelProblem) -> ModelPlan | None:
    """Every layer "gpu" and the head on the tier, when that fits (status "fits"): then
    the host reads no weights and its threads stay free. (On the slowest cards the cost
    model would have the host take a few percent of the FFN rows beside the tier, for a
    predicted gain within its own error; the contract keeps the whole model on the tier.)"""
    choice = []
    for opts in problem.layers:
        whole = [o for o in opts if o.mode == "gpu"]
        if not whole:
            return None
        choice.append(whole[0])
    if tier_bytes(problem, choice, True) > problem.budget:
        return None
    return make_plan(problem, choice, True, "fits")


def make_plan(problem: ModelProblem, choice, head_on_gpu: bool, status: str) -> ModelPlan:
    choice = tuple(choice)
    return ModelPlan(choice, head_on_gpu, total_ms(problem, choice, head_on_gpu),
                     tier_bytes(problem, choice, head_on_gpu), status)


def solve_greedy(problem: ModelProblem) -> ModelPlan:
    """The baseline: whole layers on the tier from the last one back (llama.cpp's `-ngl`
    order) while they fit, then the head once every layer is there, then the next layer's
    best split in what is left; every other layer on the host."""
    t0 = time.perf_counter()
    host = [next(o for o in opts if not o.on_tier) for opts in problem.layers]
    choice, left = list(host), problem.budget
    for l in reversed(range(len(problem.layers))):
        whole = [o for o in problem.layers[l] if o.mode == "gpu" and o.nbytes <= left]
        if not whole:
            part = [o for o in problem.layers[l] if o.on_tier and o.nbytes <= left]
            if part:
                choice[l] = min(part, key=lambda o: o.ms)
                left -= choice[l].nbytes
            break
        choice[l] = whole[0]
        left -= whole[0].nbytes
    head = all(o.mode == "gpu" for o in choice) and problem.head_bytes <= left
    plan = make_plan(problem, choice, head, "greedy")
    if plan.ms > total_ms(problem, host, False):  # nothing on the tier beats that plan
        plan = make_plan(problem, host, False, "greedy")
    return replace(plan, solve_s=time.perf_counter() - t0)
