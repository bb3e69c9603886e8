"""Allocating input sparsity (offload/profile/input_allocation.py, input_calibration.py): the
KL each slot's drops add over its floor, calibration windows spread over the whole text, and
the realized sparsity by matmul and by bytes."""

from __future__ import annotations

import pytest
import torch

from ember.models.loader import load_model
from ember.offload.body import file_blocks_model
from ember.offload.body.input_sparsity import SLOTS, apply_input_sparsity, slot_weights
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.offload.profile.input_allocation import cost_curve, slot_costs
from ember.offload.profile.input_calibration import (LEVELS, SlotStats, carve, realized_means,
                                                     spread)

needs_native = pytest.mark.skipif(not file_blocks_model.applies(),
                                  reason="C++ kernels not built on this machine")


def _slot_stats(n_layers: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {(i, s): SlotStats(torch.randn(64, 32, generator=g).abs(), torch.ones(32))
            for i in range(n_layers) for s in SLOTS}


def test_slot_costs_rank_by_the_kl_added_over_each_slots_floor():
    """A slot whose every pass costs a large floor (KL with nothing dropped) but whose drops
    add little must come out cheap: the floor is subtracted from each probe."""
    stats = _slot_stats(2)
    floors = {0: 0.05, 1: 0.0}  # layer 0: a loud floor, as layer 0 of the default model has
    added = {0: 0.001, 1: 0.01}  # ... but its drops add 10x less than layer 1's
    calls = []

    def measure(i, slot, threshold):
        calls.append((i, slot, threshold))
        if threshold == 0.0:
            return floors[i]
        level = next(p for p in (0.25, 0.5) if stats[(i, slot)].threshold(p) == threshold)
        return floors[i] + added[i] * level

    costs = slot_costs(stats, 2, measure, LEVELS, probes=(0.25, 0.5))
    assert len(calls) == 2 * len(SLOTS) * 3  # the floor and two probes per slot
    for s in SLOTS:
        st = stats[(0, s)]
        expected = cost_curve(st, [(0.25, 0.00025), (0.5, 0.0005)], LEVELS)
        assert costs[(0, s)] == pytest.approx(expected)
        assert costs[(0, s)][LEVELS.index(0.5)] < costs[(1, s)][LEVELS.index(0.5)]


def test_a_probe_below_its_floor_costs_nothing_rather_than_less_than_nothing():
    stats = _slot_stats(1)
    costs = slot_costs(stats, 1, lambda i, s, thr: 0.01 if thr == 0.0 else 0.009, LEVELS,
                       probes=(0.5,))
    assert all(c == 0.0 for curve in costs.values() for c in curve)


def test_spread_takes_evenly_spaced_runs_over_the_whole_text():
    ids = list(range(1000))
    got = spread(ids, 300, 100)
    assert len(got) == 300
    assert got[:100] == list(range(100)) and got[-100:] == list(range(900, 1000))
    assert got[100:200] == list(range(450, 550))
    assert spread(ids, 50, 100) == list(range(50))  # one run, from the start
    assert spread(ids[:40], 300, 100) == ids[:40]  # a short text is taken whole


def test_carve_sets_aside_spread_runs_that_the_rest_never_holds():
    ids = list(range(10_000))
    rest, carved = carve(ids, 300, 100)
    assert len(carved) == 300 and len(rest) == 10_000 - 300
    assert not set(rest) & set(carved) and sorted(rest + carved) == ids
    assert carved[:100] == list(range(100)) and carved[-100:] == list(range(9_900, 10_000))
    rest, carved = carve(list(range(1_000)), 2_044, 511)  # at most a fifth of the text
    assert len(carved) == 200 and len(rest) == 800
    assert carve([1, 2, 3], 300, 100) == ([1, 2, 3], [])  # too short to set anything aside


@needs_native
def test_realized_means_count_each_matmul_once_and_by_bytes(tiny_models):
    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    n = len(model.layers)
    runtime = apply_input_sparsity(model, [{"down": 1e9} for _ in range(n)])  # drop all of down
    cache = model.new_cache(32)
    model.hidden(torch.tensor([2, 40, 41, 42, 43]), cache)
    means = realized_means(runtime)
    assert means["mean_body"] == pytest.approx(1 / 7, abs=1e-4)  # down is 1 of 7 matmuls
    layer = model.layers[0]
    share = (sum(w.nbytes for w in slot_weights(layer, "down"))
             / sum(w.nbytes for s in SLOTS for w in slot_weights(layer, s)))
    assert means["mean_body_by_bytes"] == pytest.approx(share, abs=1e-4)


@needs_native
def test_profile_prints_its_texts_the_curve_and_both_means(capsys, tmp_path, tiny_models):
    """The human report says what it calibrated and checked on, the curve the search walked
    and the realized sparsity both over the 7 matmuls and by bytes."""
    from pathlib import Path

    from ember.app.cli import main

    english = Path(__file__).parent / "data" / "english.txt"
    calibration = tmp_path / "calib.txt"
    calibration.write_text(english.read_text()[:2500])
    code = main(["profile", "--model", str(tiny_models["llama-silu_glu"][2]), "--text",
                 str(calibration), "--held-out", str(english), "-o", str(tmp_path / "p"),
                 "--quality-budget", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"({calibration})" in out and f"({english})" in out
    assert "calibration tokens set aside" in out
    curve = [line for line in out.splitlines() if line.startswith("    ") and "%: x" in line]
    assert len(curve) == 6  # one row per bisection step
    assert "mean over the body's 7 matmuls" in out and "weighted by their bytes" in out
