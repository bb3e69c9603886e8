"""A fast near-optimal answer to the whole-model problem (`layer_modes.ModelProblem`): what
the ILP must beat, and what it returns when CBC runs out of time on a busy machine.

Price every tier byte at lambda ms and the budget disappears: each layer then takes the option
of least ms + lambda x bytes, except that changing sides costs `cross_ms`, which a dynamic
program along the chain (host -> layers -> head -> host, two states: host or tier) settles
exactly in O(layers x options). The bytes of its answer fall as lambda grows; a bisection
finds the smallest lambda whose answer fits. Bytes left over (the budget is rarely met
exactly) go to the upgrades that save the most ms per byte, one layer at a time.
"""

from __future__ import annotations

from .layer_modes import LayerOption, ModelProblem, tier_bytes


def _chain(problem: ModelProblem, layers, lam: float):
    """The choice of least ms + lam * bytes, crossings included: (choice, head_on_gpu)."""
    inf = float("inf")
    # cost[s]: best so far ending on side s (0 host, 1 tier); the chain starts on the host
    cost, back = [0.0, inf], []
    for opts in layers:
        best = [(inf, None, 0), (inf, None, 0)]  # per side: (cost, option, previous side)
        for o in opts:
            s = int(o.on_tier)
            for prev in (0, 1):
                c = cost[prev] + o.ms + lam * o.nbytes + problem.cross_ms * (prev != s)
                if c < best[s][0]:
                    best[s] = (c, o, prev)
        back.append(best)
        cost = [best[0][0], best[1][0]]
    # the head, then back to the host
    ends = []
    for head in (0, 1):
        ms = problem.head_gpu_ms + lam * problem.head_bytes if head else problem.head_cpu_ms
        for prev in (0, 1):
            ends.append((cost[prev] + ms + problem.cross_ms * ((prev != head) + head),
                         prev, bool(head)))
    _, side, head = min(ends, key=lambda e: e[0])
    choice = []
    for best in reversed(back):
        _, o, prev = best[side]
        choice.append(o)
        side = prev
    return choice[::-1], head


def _fill(problem: ModelProblem, layers, choice, head: bool):
    """Spend the bytes left on the upgrades that save the most ms per byte."""
    choice = list(choice)
    while True:
        left = problem.budget - tier_bytes(problem, choice, head)
        sides = [False] + [o.on_tier for o in choice] + [head]
        best, gain = None, 0.0
        for l, opts in enumerate(layers):
            now = choice[l]
            before, after = sides[l], sides[l + 2]  # the neighbours along the chain
            for o in opts:
                extra = o.nbytes - now.nbytes
                if not 0 < extra <= left:
                    continue
                crossed = ((before != o.on_tier) + (o.on_tier != after)
                           - (before != now.on_tier) - (now.on_tier != after))
                saved = now.ms - o.ms - problem.cross_ms * crossed
                if saved / extra > gain:
                    best, gain = (l, o), saved / extra
        if best is None:
            return choice
        choice[best[0]] = best[1]


def lagrange_plan(problem: ModelProblem, layers: list[list[LayerOption]],
                  rounds: int = 40) -> tuple[list[LayerOption], bool]:
    """(choice, head_on_gpu) within the budget: the bisection's answer, filled."""
    def fits(plan):
        return tier_bytes(problem, *plan) <= problem.budget

    lo, hi = 0.0, 1.0
    plan = _chain(problem, layers, lo)
    if not fits(plan):
        while not fits(_chain(problem, layers, hi)):
            hi *= 4
            if hi > 1e12:  # nothing on the tier fits: every layer and the head on the host
                return [next(o for o in opts if not o.on_tier) for opts in layers], False
        for _ in range(rounds):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(_chain(problem, layers, mid)) else (mid, hi)
        plan = _chain(problem, layers, hi)
    choice, head = plan
    return _fill(problem, layers, choice, head), head
