"""The whole-model problem (`layer_modes.ModelProblem`) solved exactly: the integer program in
`layer_modes`' docstring, by CBC through PuLP, started from nothing and checked against the
chain DP's answer (layer_modes_dp.py), which it must beat to be returned.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

from .layer_modes import (ModelPlan, ModelProblem, make_plan, pruned, solve_greedy,
                          tier_bytes, whole_model)
from .layer_modes_dp import lagrange_plan

_MIB = float(1 << 20)


def solve_layers(problem: ModelProblem, time_limit_s: float = 5.0,
                 gap_rel: float = 5e-3, whole_first: bool = True) -> ModelPlan:
    """The cheapest plan within the budget (CBC through PuLP); never worse than the chain
    DP's plan or the greedy one, the better of which is the answer when CBC finds nothing
    better in time (status "fallback").

    gap_rel: CBC stops within this fraction of the optimum. The relaxation's gap on the
    Llama-2 shapes is 0.02-0.3% (the budget's last layer or granule cannot be filled
    exactly); proving the last 0.1% took CBC over 30 s on two cores, for a difference far
    below the cost model's own error. 0 proves optimality (the tests' small problems).
    whole_first: the whole model on the tier whenever it fits (`whole_model`), unsolved."""
    import pulp  # lazily: `ember --help` should not pay for it

    t0 = time.perf_counter()
    whole = whole_model(problem) if whole_first else None
    if whole is not None:
        return replace(whole, solve_s=time.perf_counter() - t0)
    layers = [pruned(opts, problem.budget) for opts in problem.layers]
    fallback = min(solve_greedy(problem), make_plan(problem, *lagrange_plan(problem, layers), ""),
                   key=lambda p: p.ms)
    fallback = replace(fallback, status="fallback")
    with warnings.catch_warnings():  # PuLP 3 announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        model, xs, head = _build(problem, layers, pulp)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(float(time_limit_s), 0.01),
                                   gapRel=gap_rel)
        try:
            model.solve(solver)
            status = {pulp.LpSolutionOptimal: "optimal",
                      pulp.LpSolutionIntegerFeasible: "time_limit"}.get(model.sol_status)
        except pulp.PulpSolverError:
            status = None
    best = fallback
    if status is not None:
        choice = [next((o for o, x in zip(opts, vs) if (x.value() or 0) > 0.5), None)
                  for opts, vs in zip(layers, xs)]
        on = (head.value() or 0) > 0.5
        if None not in choice and tier_bytes(problem, choice, on) <= problem.budget:
            plan = make_plan(problem, choice, on, status)
            if plan.ms <= fallback.ms:
                best = plan
    return replace(best, solve_s=time.perf_counter() - t0)


def _build(problem: ModelProblem, layers, pulp):
    model = pulp.LpProblem("ember_layer_modes", pulp.LpMinimize)
    head = pulp.LpVariable("head", 0, 1, cat="Integer")
    objective = [(head, problem.head_gpu_ms - problem.head_cpu_ms)]
    budget = [(head, problem.head_bytes / _MIB)]
    xs, sides = [], []
    for l, opts in enumerate(layers):
        v = [pulp.LpVariable(f"x_{l}_{i}", 0, 1, cat="Integer") for i in range(len(opts))]
        model.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression([(x, 1.0) for x in v]),
                                              pulp.LpConstraintEQ, rhs=1.0), f"one_{l}")
        objective += [(x, o.ms) for x, o in zip(v, opts)]
        budget += [(x, o.nbytes / _MIB) for x, o in zip(v, opts) if o.nbytes]
        sides.append([(x, 1.0) for x, o in zip(v, opts) if o.on_tier])
        xs.append(v)
    # The chain's sides as lists of (variable, coefficient); the two ends are the host (0).
    chain = [[], *sides, [(head, 1.0)], []]
    cs = []
    for j in range(1, len(chain)):
        c = pulp.LpVariable(f"c_{j}", 0, 1)
        cs.append((c, 1.0))
        objective.append((c, problem.cross_ms))
        for a, b in ((chain[j], chain[j - 1]), (chain[j - 1], chain[j])):
            expr = pulp.LpAffineExpression([(c, 1.0)] + [(x, -k) for x, k in a]
                                           + [(x, k) for x, k in b])
            model.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE, rhs=0.0))
    # Valid for whole plans, and what makes the relaxation tight: a chain that starts and
    # ends on the host and visits the tier anywhere crosses at least twice.
    for node in chain[1:-1]:
        expr = pulp.LpAffineExpression(cs + [(x, -2.0 * k) for x, k in node])
        model.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE, rhs=0.0))
    model += pulp.LpAffineExpression(objective)
    model.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(budget), pulp.LpConstraintLE,
                                          rhs=problem.budget / _MIB), "budget")
    return model, xs, head
