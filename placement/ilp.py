"""The exact placement: a multiple-choice knapsack solved by CBC through PuLP.

For a given hot count the hottest neurons are best (see `problem.py`), so a layer's whole choice
is how many of its leading groups are hot, and the cost model gives that choice's latency and
bytes exactly (`layer_curve`). One binary x[l, k] per layer l and reachable group count k:

    minimize    sum_{l,k} latency[l, k] * x[l, k]
    subject to  sum_k x[l, k] = 1                                  (one choice per layer)
                sum_{l,k} bytes[l, k] * x[l, k] <= budget

Counts k with 0 < hot < min_hot are left out. So is every k whose latency is no lower than a
smaller count's: it would cost more bytes for nothing. Past the point where the GPU side
becomes the slower one, latency only grows, so that prunes most large counts; an all-hot layer
(no CPU side, no split overhead) stays when it is cheaper. The LP relaxation of this model is the
lower convex hull of each layer's (bytes, latency) points, which is tight; CBC closes a 0.1%
gap in few nodes. An earlier formulation (integer counts, the CPU side as chords of its convex curve,
binaries for "any hot" and "all hot") was several times slower on 70B-sized problems: its
relaxation charges the split overhead and minimum only fractionally.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import numpy as np

from .cost_model import PlacementResult, layer_curve, result_from_groups
from .greedy import greedy_groups
from .problem import PlacementProblem

_MIB = float(1 << 20)


def solve_ilp(problem: PlacementProblem, time_limit_s: float = 8.0, threads: int | None = None,
              gap_rel: float = 1e-3) -> PlacementResult:
    """Minimize expected per-token FFN latency under the byte budget.

    Args:
        time_limit_s: CBC stops here and its best incumbent is returned (status "time_limit").
            If that is worse than the greedy placement (or CBC found nothing), the greedy
            placement is returned (status "fallback"): the answer is never worse than greedy.
        threads: CBC threads (default: CBC's own choice).
        gap_rel: relative optimality gap at which CBC stops and calls the answer optimal
            (1e-3: within 0.1% of the best latency, well below the noise of measured costs;
            closing the last 0.01% took CBC from ~1 s to over 20 s on 7B-sized problems;
            0 proves optimality exactly).
    Returns:
        A PlacementResult with method "ilp"; status "optimal" (within gap_rel), "time_limit"
        or "fallback" (CBC produced no usable answer: the greedy placement).
    """
    import pulp  # lazily: `ember --help` should not pay for it

    t0 = time.perf_counter()
    start = greedy_groups(problem)
    fallback = result_from_groups(problem, start, "ilp", "fallback", 0.0)
    with warnings.catch_warnings():  # PuLP 3 announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        model, choices = _build(problem, pulp)
        status = _run_cbc(model, pulp, time_limit_s, threads, gap_rel)
    best = fallback
    groups = [_chosen(layer) for layer in choices] if status is not None else [None]
    if None not in groups:
        result = result_from_groups(problem, groups, "ilp", status, 0.0)
        # Checked on exact numbers (CBC works to tolerances). Within the gap, greedy can be a
        # hair better; then it is the answer, and just as optimal.
        if result.evaluation.feasible:
            best = result if result.objective_ms <= fallback.objective_ms else \
                replace(fallback, status=status)
    return replace(best, solve_s=time.perf_counter() - t0)


def candidates(problem: PlacementProblem, layer: int) -> list[int]:
    """Group counts worth considering for `layer`: allowed, within budget, not dominated."""
    g, cost = problem.groups(layer), layer_curve(problem, layer)
    allowed = [0] + list(range(max(problem.min_groups(layer), 1), g.n_groups + 1))
    keep, best = [], np.inf
    for k in allowed:
        if g.hot_counts[k] * problem.neuron_bytes[layer] > problem.budget_bytes:
            break  # bytes grow with k
        if cost[k] < best:
            keep.append(k)
            best = cost[k]
    return keep


def _build(problem: PlacementProblem, pulp):
    """The model, and per layer the list of (k, x[l, k])."""
    model = pulp.LpProblem("ember_placement", pulp.LpMinimize)
    objective, budget, choices = [], [], []
    for l in range(problem.n_layers):
        ks = candidates(problem, l)
        cost, counts = layer_curve(problem, l), problem.groups(l).hot_counts
        xs = [pulp.LpVariable(f"x_{l}_{k}", 0, 1, cat="Integer") for k in ks]
        # Built as expressions directly: PuLP's operator overloading is slow at this size.
        model.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(x, 1.0) for x in xs]),
                                              pulp.LpConstraintEQ, rhs=1.0), f"one_{l}")
        objective += [(x, float(cost[k])) for x, k in zip(xs, ks)]
        budget += [(x, float(counts[k] * problem.neuron_bytes[l] / _MIB))
                   for x, k in zip(xs, ks) if k]
        choices.append(list(zip(ks, xs)))
    model += pulp.LpAffineExpression(objective)
    model.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(budget), pulp.LpConstraintLE,
                                          rhs=problem.budget_bytes / _MIB), "budget")
    return model, choices


def _chosen(layer_choices) -> int | None:
    picked = [k for k, x in layer_choices if (x.value() or 0.0) > 0.5]
    return picked[0] if len(picked) == 1 else None


def _run_cbc(model, pulp, time_limit_s: float, threads, gap_rel: float) -> str | None:
    """Solve; "optimal", "time_limit" (an incumbent, optimality unproven) or None (nothing).

    No MIP start: with the greedy answer as one, CBC 2.10.3 (PuLP's bundled binary) took 20x
    longer on the 70B benchmark and can crash when the time limit expires at the root node.
    The greedy answer is the floor instead (see `solve_ilp`).
    """
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(float(time_limit_s), 0.01),
                               gapRel=gap_rel, threads=threads)
    try:
        model.solve(solver)
    except pulp.PulpSolverError:
        return None
    if model.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if model.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit"
    return None
