"""The whole-model placement (per layer gpu / split / cpu, and the LM head): the ILP is exact
against brute force on small problems, never worse than the greedy baseline, within the
budget, and fast at 80 layers."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from ember.placement.layer_modes import (LayerOption, ModelProblem, crossings, pruned,
                                         solve_greedy, tier_bytes, total_ms)
from ember.placement.layer_modes_dp import lagrange_plan
from ember.placement.layer_modes_ilp import solve_layers


def _random_problem(seed: int, n_layers: int, splits: int = 3) -> ModelProblem:
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        attention, ffn = rng.integers(10, 40), rng.integers(40, 120)
        host_ms = rng.uniform(1.0, 3.0)
        opts = [LayerOption("cpu", 0, 0, host_ms),
                LayerOption("gpu", 8, int(attention + ffn), rng.uniform(0.05, 0.3))]
        for k in range(splits):
            hot = int(rng.integers(0, 8))
            opts.append(LayerOption("split", hot, int(attention + ffn * hot / 8),
                                    rng.uniform(0.2, 2.5)))
        layers.append(tuple(opts))
    total = sum(max(o.nbytes for o in opts) for opts in layers)
    return ModelProblem(tuple(layers), head_bytes=int(rng.integers(20, 80)),
                        head_gpu_ms=rng.uniform(0.05, 0.2), head_cpu_ms=rng.uniform(0.5, 2.0),
                        cross_ms=rng.uniform(0.0, 0.8),
                        budget=int(rng.uniform(0.1, 1.1) * total))


def _brute_force(problem: ModelProblem) -> float:
    best = float("inf")
    for choice in itertools.product(*problem.layers):
        for head in (False, True):
            if tier_bytes(problem, choice, head) <= problem.budget:
                best = min(best, total_ms(problem, choice, head))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_ilp_matches_brute_force(seed):
    problem = _random_problem(seed, n_layers=4)
    plan = solve_layers(problem, gap_rel=0.0, whole_first=False)
    assert plan.nbytes == tier_bytes(problem, plan.choice, plan.head_on_gpu) <= problem.budget
    assert plan.ms == pytest.approx(total_ms(problem, plan.choice, plan.head_on_gpu))
    assert plan.ms == pytest.approx(_brute_force(problem), rel=1e-9)
    assert plan.ms <= solve_greedy(problem).ms + 1e-12


def test_crossings_count_side_changes_from_and_back_to_the_host():
    assert crossings([False, False], False) == 0
    assert crossings([True, True], True) == 2  # embedding up, token back
    assert crossings([False, True, True], False) == 2
    assert crossings([True, False, True], False) == 4


def test_crossings_make_the_plan_keep_the_tier_layers_together():
    """Three of four layers fit on the tier: with a dear hand-over they sit next to each
    other (two crossings, not four), and the head stays on the host (it would cost a layer)."""
    cpu, gpu = LayerOption("cpu", 0, 0, 1.0), LayerOption("gpu", 4, 10, 0.1)
    layers = tuple((cpu, gpu) for _ in range(4))
    problem = ModelProblem(layers, head_bytes=10, head_gpu_ms=0.05, head_cpu_ms=0.5,
                           cross_ms=0.3, budget=30)
    plan = solve_layers(problem, gap_rel=0.0)
    assert plan.counts() == {"gpu": 3, "split": 0, "cpu": 1} and not plan.head_on_gpu
    assert crossings([o.on_tier for o in plan.choice], False) == 2
    assert plan.ms == pytest.approx(1.0 + 3 * 0.1 + 0.5 + 2 * 0.3)


def test_when_everything_fits_every_layer_and_the_head_are_on_the_tier():
    problem = _random_problem(3, n_layers=6)
    roomy = ModelProblem(problem.layers, problem.head_bytes, 0.01, 1.0, problem.cross_ms,
                         budget=10**9)
    plan = solve_layers(roomy)
    assert plan.status == "fits" and plan.head_on_gpu and set(plan.modes) == {"gpu"}
    # Solved instead, the tier side still holds every layer and the head
    solved = solve_layers(roomy, gap_rel=0.0, whole_first=False)
    assert solved.head_on_gpu and "cpu" not in solved.modes
    assert solved.ms <= plan.ms


def test_pruning_keeps_one_host_option_and_the_tier_frontier():
    opts = [LayerOption("cpu", 0, 0, 2.0), LayerOption("split", 2, 20, 1.0),
            LayerOption("split", 3, 30, 1.5), LayerOption("gpu", 4, 40, 0.2),
            LayerOption("split", 1, 10, 3.0)]
    kept = pruned(opts, budget=35)
    assert [(o.mode, o.hot) for o in kept] == [("cpu", 0), ("split", 1), ("split", 2)]


def test_eighty_layers_solve_in_seconds():
    problem = _random_problem(7, n_layers=80, splits=100)
    t0 = time.perf_counter()
    plan = solve_layers(problem)
    assert time.perf_counter() - t0 < 20  # two shared cores: generous
    assert plan.status in ("optimal", "time_limit", "fallback")
    assert plan.ms <= solve_greedy(problem).ms + 1e-9
    assert plan.nbytes <= problem.budget


@pytest.mark.parametrize("seed", range(8))
def test_the_chain_dp_fits_and_comes_close(seed):
    """The ILP's starting answer: within the budget, and near the optimum (a priced budget
    leaves a little unspent on small problems; the greedy upgrades take most of it)."""
    problem = _random_problem(seed, n_layers=4)
    layers = [pruned(opts, problem.budget) for opts in problem.layers]
    choice, head = lagrange_plan(problem, layers)
    assert tier_bytes(problem, choice, head) <= problem.budget
    assert total_ms(problem, choice, head) <= 1.25 * _brute_force(problem) + 1e-9


def test_the_chain_dp_is_within_a_few_percent_on_a_llama_sized_problem():
    problem = _random_problem(11, n_layers=40, splits=40)
    layers = [pruned(opts, problem.budget) for opts in problem.layers]
    choice, head = lagrange_plan(problem, layers)
    best = solve_layers(problem, gap_rel=1e-4, time_limit_s=30, whole_first=False)
    assert total_ms(problem, choice, head) <= 1.03 * best.ms
