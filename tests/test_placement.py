"""The placement solvers: the ILP is exact (brute force agrees), never worse than greedy, and
strictly better where CPU/GPU balance matters; every answer is feasible; inputs are validated."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from ember.models.support.errors import ConfigError
from ember.placement import (Placement, PlacementProblem, default_group_size, evaluate,
                             solve)
from ember.placement.cost_model import layer_curve
from ember.placement.ilp import solve_ilp


def _random_problem(seed: int, n_layers: int, sizes=(20, 60), group_size=None, **over):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(sizes[0], sizes[1] + 1, n_layers)
    freqs = [rng.permutation(np.clip(rng.uniform(0.02, 1.0) * rng.random(n) ** rng.uniform(1, 4),
                                     0, 1)) for n in sizes]
    nbytes = rng.uniform(1.0, 3.0, n_layers)
    kw = dict(
        freqs=freqs, neuron_bytes=nbytes,
        gpu_ms_per_neuron=rng.uniform(1e-4, 2e-3, n_layers),
        cpu_ms_per_active=rng.uniform(1e-3, 2e-2, n_layers),
        budget_bytes=rng.uniform(0.1, 0.7) * float(np.dot(sizes, nbytes)),
        gpu_base_ms=rng.uniform(0, 0.01, n_layers), cpu_base_ms=rng.uniform(0, 0.01, n_layers),
        split_ms=rng.uniform(0, 0.03, n_layers), min_hot=rng.integers(0, 12, n_layers),
        group_size=group_size if group_size is not None else int(rng.integers(1, 12)))
    kw.update(over)
    return PlacementProblem(**kw)


def _brute_force(problem: PlacementProblem) -> float:
    """Cheapest feasible placement, enumerating groups hot per layer."""
    curves = [layer_curve(problem, l) for l in range(problem.n_layers)]
    best = np.inf
    ranges = [range(problem.groups(l).n_groups + 1) for l in range(problem.n_layers)]
    for ks in itertools.product(*ranges):
        counts = [problem.groups(l).hot_counts[k] for l, k in enumerate(ks)]
        if any(0 < h < m for h, m in zip(counts, problem.min_hot)):
            continue
        if np.dot(counts, problem.neuron_bytes) > problem.budget_bytes:
            continue
        best = min(best, sum(c[k] for c, k in zip(curves, ks)))
    return float(best)


def _check_feasible(problem: PlacementProblem, result) -> None:
    ev = evaluate(problem, result.placement)
    assert ev.within_budget and ev.min_hot_ok
    assert ev.hot_bytes <= problem.budget_bytes * (1 + 1e-12)
    assert result.objective_ms == pytest.approx(ev.total_ms)
    for l, f in enumerate(problem.freqs):
        hot = result.placement.hot[l]
        assert hot.size == 0 or hot.size >= problem.min_hot[l]
        cold = result.placement.cold(l)
        if hot.size and cold.size:  # the hot set is the layer's hottest neurons
            assert f[hot].min() >= f[cold].max()


# -- exactness --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_ilp_matches_brute_force(seed):
    problem = _random_problem(seed, n_layers=2 + seed % 2, sizes=(8, 30),
                              group_size=4 + seed % 4)
    result = solve_ilp(problem, time_limit_s=10, gap_rel=0.0)
    assert result.status == "optimal"
    _check_feasible(problem, result)
    assert result.objective_ms == pytest.approx(_brute_force(problem), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_ilp_never_worse_than_greedy(seed):
    problem = _random_problem(100 + seed, n_layers=6, sizes=(50, 200))
    ilp, greedy = solve(problem, "ilp", time_limit_s=10), solve(problem, "greedy")
    _check_feasible(problem, ilp)
    _check_feasible(problem, greedy)
    assert ilp.objective_ms <= greedy.objective_ms + 1e-12


def test_ilp_beats_greedy_when_cpu_speed_differs():
    # Layer 0's neurons are hotter, but layer 1's CPU side is 10x slower per active neuron:
    # moving layer 1's neurons saves more time per byte. Greedy goes by frequency alone.
    n = 64
    problem = PlacementProblem(freqs=[np.full(n, 0.5), np.full(n, 0.3)], neuron_bytes=1.0,
                               gpu_ms_per_neuron=1e-5, cpu_ms_per_active=[1e-3, 1e-2],
                               budget_bytes=n, group_size=8)
    ilp, greedy = solve(problem, "ilp"), solve(problem, "greedy")
    assert greedy.placement.hot_count(0) == n and greedy.placement.hot_count(1) == 0
    assert ilp.placement.hot_count(1) == n
    assert ilp.objective_ms < 0.5 * greedy.objective_ms


def test_ilp_beats_greedy_when_gpu_side_binds():
    # Layer 0 is hotter but its GPU side is slow: making it all hot costs more than it saves.
    # The ILP balances layer 0 (GPU ~ CPU) and spends the rest on layer 1.
    n = 100
    problem = PlacementProblem(freqs=[np.full(n, 0.6), np.full(n, 0.4)], neuron_bytes=1.0,
                               gpu_ms_per_neuron=[1e-3, 1e-5], cpu_ms_per_active=1e-3,
                               budget_bytes=n, group_size=5)
    ilp, greedy = solve(problem, "ilp"), solve(problem, "greedy")
    assert greedy.placement.hot_count(0) == n
    assert 0 < ilp.placement.hot_count(0) < n and ilp.placement.hot_count(1) > 0
    assert ilp.objective_ms < 0.7 * greedy.objective_ms


def test_split_overhead_and_minimum():
    # A split costs more than it saves in layer 1 (few active neurons); min_hot forbids tiny splits.
    rng = np.random.default_rng(7)
    problem = PlacementProblem(freqs=[rng.random(40), np.full(40, 0.01)], neuron_bytes=1.0,
                               gpu_ms_per_neuron=1e-4, cpu_ms_per_active=1e-2,
                               budget_bytes=60, split_ms=[0.0, 1.0], min_hot=[10, 10],
                               group_size=3)
    result = solve_ilp(problem, gap_rel=0.0)
    _check_feasible(problem, result)
    assert result.placement.hot_count(1) in (0, 40)
    assert result.objective_ms == pytest.approx(_brute_force(problem))


# -- feasibility and edge cases ---------------------------------------------------------------
def test_indices_are_original_numbering():
    freqs = np.array([0.1, 0.9, 0.0, 0.8, 0.5, 0.7])
    problem = PlacementProblem(freqs=[freqs], neuron_bytes=1.0, gpu_ms_per_neuron=1e-6,
                               cpu_ms_per_active=1.0, budget_bytes=3)
    for method in ("ilp", "greedy"):
        assert solve(problem, method).placement.hot[0].tolist() == [1, 3, 5]


def test_tiny_budget_gives_all_cold():
    problem = _random_problem(3, n_layers=3, budget_bytes=0.5, min_hot=0)
    for method in ("ilp", "greedy"):
        result = solve(problem, method)
        assert all(result.placement.hot_count(l) == 0 for l in range(3))
        _check_feasible(problem, result)


def test_budget_below_minimum_split_gives_all_cold():
    problem = _random_problem(4, n_layers=2, sizes=(40, 40), neuron_bytes=1.0, budget_bytes=9,
                              min_hot=10, group_size=1)
    assert solve(problem, "ilp").placement.total_hot_fraction() == 0.0
    assert solve(problem, "greedy").placement.total_hot_fraction() == 0.0


def test_large_budget_with_fast_gpu_puts_everything_hot():
    problem = _random_problem(5, n_layers=3, budget_bytes=1e9, gpu_ms_per_neuron=1e-9,
                              gpu_base_ms=0.0)
    result = solve(problem, "ilp")
    assert result.placement.total_hot_fraction() == 1.0


def test_time_limit_returns_feasible_incumbent():
    problem = _random_problem(11, n_layers=40, sizes=(400, 800), group_size=2)
    result = solve(problem, "ilp", time_limit_s=0.5)
    assert result.status in ("optimal", "time_limit", "fallback")
    _check_feasible(problem, result)
    assert result.objective_ms <= solve(problem, "greedy").objective_ms + 1e-12


def test_solver_crash_falls_back_to_greedy(monkeypatch):
    # A solver that dies (PuLP raises PulpSolverError) must still leave a placement.
    import pulp

    class Crashing(pulp.PULP_CBC_CMD):
        def actualSolve(self, lp, **kwargs):
            raise pulp.PulpSolverError("simulated crash")

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", Crashing)
    problem = _random_problem(12, n_layers=4)
    result = solve(problem, "ilp")
    assert result.status == "fallback"
    _check_feasible(problem, result)
    assert result.objective_ms == solve(problem, "greedy").objective_ms


def test_evaluate_by_hand():
    problem = PlacementProblem(freqs=[[0.5, 0.25, 0.125, 0.125]], neuron_bytes=2.0,
                               gpu_ms_per_neuron=0.1, cpu_ms_per_active=1.0, budget_bytes=4,
                               gpu_base_ms=0.05, cpu_base_ms=0.02, split_ms=0.01)
    ev = evaluate(problem, Placement((4,), (np.array([0, 1]),)))
    # gpu 0.05 + 0.2 = 0.25; cpu 0.02 + 0.25 = 0.27; + split 0.01
    assert ev.total_ms == pytest.approx(0.28) and ev.hot_bytes == 4.0 and ev.feasible
    assert evaluate(problem, Placement((4,), (np.array([], dtype=np.int64),))).total_ms \
        == pytest.approx(1.02)
    all_hot = evaluate(problem, Placement((4,), (np.arange(4),)))
    assert all_hot.total_ms == pytest.approx(0.45) and not all_hot.within_budget
    with pytest.raises(ConfigError, match="layer sizes"):
        evaluate(problem, Placement((5,), (np.array([0]),)))


# -- validation -------------------------------------------------------------------------------
def _kw(**over):
    kw = dict(freqs=[[0.5, 0.2], [0.1, 0.3, 0.9]], neuron_bytes=1.0, gpu_ms_per_neuron=1e-3,
              cpu_ms_per_active=1e-2, budget_bytes=2.0)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over, field", [
    (dict(budget_bytes=-1), "budget_bytes"),
    (dict(budget_bytes=float("nan")), "budget_bytes"),
    (dict(neuron_bytes=[1.0, 2.0, 3.0]), "neuron_bytes"),
    (dict(cpu_ms_per_active=[1e-2]), "cpu_ms_per_active"),
    (dict(gpu_ms_per_neuron=-1e-3), r"gpu_ms_per_neuron\[0\]"),
    (dict(split_ms=[0.0, -1.0]), r"split_ms\[1\]"),
    (dict(freqs=[[0.5, 1.2], [0.1]]), r"freqs\[0\]"),
    (dict(freqs=[[0.5], [-0.1]]), r"freqs\[1\]"),
    (dict(freqs=[[0.5], [float("nan")]]), r"freqs\[1\]"),
    (dict(freqs=[[0.5], []]), r"freqs\[1\]"),
    (dict(freqs=[]), "freqs"),
    (dict(group_size=0), "group_size"),
    (dict(group_size=1.5), "group_size"),
    (dict(group_size=None), "group_size"),
    (dict(group_size=float("inf")), "group_size"),
    (dict(min_hot=[0, 4]), r"min_hot\[1\]"),
    (dict(min_hot=1.5), r"min_hot\[0\]"),
])
def test_invalid_inputs_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        PlacementProblem(**_kw(**over))


def test_solve_rejects_bad_method_and_time_limit():
    problem = PlacementProblem(**_kw())
    with pytest.raises(ConfigError, match="method"):
        solve(problem, "anneal")
    with pytest.raises(ConfigError, match="time limit"):
        solve(problem, "ilp", time_limit_s=0)


def test_default_group_size():
    assert default_group_size([28672] * 80) == 128
    assert default_group_size([2048] * 18) == 2
    assert default_group_size([100]) == 1


# -- the benchmark command --------------------------------------------------------------------
def test_bench_placement_small(monkeypatch, capsys):
    from ember.app.cli import build_parser
    from ember.app.commands import bench_placement

    monkeypatch.setattr(bench_placement, "LAYERS", 6)
    monkeypatch.setattr(bench_placement, "FFN", 1024)
    # 2.92 GiB of attention, LM head, KV cache and reserve at 6 layers: ~40 MiB for FFN neurons.
    args = build_parser().parse_args(["bench", "placement", "--json", "--gpu-gib", "2.96",
                                      "--group-size", "8",
                                      "--time-limit", "5"])
    assert args.handler == "bench_placement"
    assert bench_placement.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ilp"]["feasible"] and report["greedy"]["feasible"]
    assert report["ilp"]["objective_ms"] <= report["greedy"]["objective_ms"] + 1e-9
    assert report["greedy_over_ilp"] >= 1.0 and report["problem"]["group_size"] == 8
