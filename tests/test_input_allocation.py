"""Allocating input sparsity (offload/profile/input_allocation.py, input_calibration.py): the
KL each slot's drops add over its floor, calibration windows spread over the whole text, and
the realized sparsity by matmul and by bytes."""

from __future__ import annotations

import pytest
import torch

from ember.models.loader import load_model
from ember.offload.body import quant_model
from ember.offload.body.input_sparsity import SLOTS, apply_input_sparsity, slot_weights
from ember.offload.body.quant_model import QuantModel
from ember.offload.profile.input_allocation import cost_curve, probed_layers, slot_costs
from ember.offload.profile.input_calibration import (LEVELS, SlotStats, carve, realized_means,
                                                     spread)

needs_native = pytest.mark.skipif(not quant_model.applies(),
                                  reason="C++ kernels not built on this machine")


def _slot_stats(n_layers: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {(i, s): SlotStats(torch.randn(64, 32, generator=g).abs(), torch.ones(32))
            for i in range(n_layers) for s in SLOTS}


def test_slot_costs_rank_by_the_kl_added_over_each_layers_floor():
    """A slot whose every pass costs a large floor (KL with nothing dropped) but whose drops
    add little must come out cheap: the layer's floor is subtracted from each probe."""
    stats = _slot_stats(2)
    floors = {0: 0.05, 1: 0.0}  # layer 0: a loud floor, as layer 0 of the default model has
    added = {0: 0.001, 1: 0.01}  # ... but its drops add 10x less than layer 1's
    calls = []

    def measure(i, thresholds):
        calls.append((i, dict(thresholds)))
        if all(v == 0.0 for v in thresholds.values()):
            assert set(thresholds) == set(SLOTS)  # the floor: the whole layer, nothing dropped
            return floors[i]
        (slot, threshold), = thresholds.items()
        level = next(p for p in (0.25, 0.5) if stats[(i, slot)].threshold(p) == threshold)
        return floors[i] + added[i] * level

    costs = slot_costs(stats, 2, measure, LEVELS, probes=(0.25, 0.5), every=1)
    assert len(calls) == 2 * (1 + len(SLOTS) * 2)  # per layer the floor, two probes per slot
    for s in SLOTS:
        st = stats[(0, s)]
        expected = cost_curve(st, [(0.25, 0.00025), (0.5, 0.0005)], LEVELS)
        assert costs[(0, s)] == pytest.approx(expected)
        assert costs[(0, s)][LEVELS.index(0.5)] < costs[(1, s)][LEVELS.index(0.5)]


def test_layers_between_probed_ones_take_their_gains_interpolated():
    """Probing every second layer (and the last): 5 layers probe 0, 2 and 4; layer 1's gain
    (KL added per unit of proxy error) is the mean of layers 0 and 2, applied to its own
    proxy error curve."""
    stats = _slot_stats(5)
    gain = {0: 1.0, 2: 3.0, 4: 0.5}
    probed = []

    def measure(i, thresholds):
        if all(v == 0.0 for v in thresholds.values()):
            probed.append(i)
            return 0.0
        (slot, threshold), = thresholds.items()
        return gain[i] * stats[(i, slot)].error(0.5)

    assert probed_layers(5, 2) == [0, 2, 4] and probed_layers(6, 2) == [0, 2, 4, 5]
    costs = slot_costs(stats, 5, measure, LEVELS, probes=(0.5,), every=2)
    assert probed == [0, 2, 4]
    for i, g in ((1, 2.0), (3, 1.75), (2, 3.0)):
        for s in SLOTS:
            st = stats[(i, s)]
            assert costs[(i, s)] == pytest.approx(cost_curve(st, [(0.5, g * st.error(0.5))],
                                                             LEVELS))


def test_a_probe_below_its_floor_costs_nothing_rather_than_less_than_nothing():
    stats = _slot_stats(1)
    costs = slot_costs(stats, 1, lambda i, th: 0.01 if len(th) == len(SLOTS) else 0.009, LEVELS,
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
    model = QuantModel(load_model(tiny_models["llama-silu_glu"][2]).source)
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
    """The human report says what it calibrated and checked on, the curve the search walked,
    the realized sparsity both over the 7 matmuls and by bytes, and each stage's time."""
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
    curve = [line for line in out.splitlines() if line.startswith("    ") and "%), x" in line]
    assert len(curve) == 6  # one row per bisection step
    # and how long each stage took
    stages = next(line for line in out.splitlines() if line.startswith("  stages"))
    for name in ("calibration", "input statistics", "slot costs", "search", "payoff", "check"):
        assert f"{name} " in stages
    assert "mean over the body's 7 matmuls" in out and "weighted by their bytes" in out


@needs_native
def test_a_probe_re_runs_from_its_layer_with_the_bits_of_the_whole_pass(tiny_models):
    """The layer chain's dense pass is the model's bit for bit, and a probe of layer i,
    re-run from what entered layer i, equals the whole model's pass with that one slot
    thresholded: skipping the layers before it changes nothing but the time."""
    from ember.offload.profile.layer_chain import LayerChain

    model = QuantModel(load_model(tiny_models["llama-silu_glu"][2]).source)
    n = len(model.layers)
    runtime = apply_input_sparsity(model, [{} for _ in range(n)])
    chain = LayerChain(model, runtime)
    seg = torch.tensor([2, 40, 41, 42, 43, 44, 45])
    cache = model.new_cache(16)
    xs = chain.dense_inputs(seg, cache)
    whole = model.hidden(seg, model.new_cache(16))
    assert torch.equal(chain.final(xs[-1]), whole)
    for layer, slot in ((1, "down"), (n - 1, "qkv")):
        threshold = float(xs[layer].abs().median())  # drops something in any slot
        chain.threshold(layer, slot, threshold)
        probe = chain.hidden_from(layer, xs[layer], cache)
        chain.threshold(layer, slot, None)
        runtime.set_thresholds([{slot: threshold} if i == layer else {} for i in range(n)])
        assert torch.equal(probe, model.hidden(seg, model.new_cache(16)))
        assert not torch.equal(probe, whole)
        runtime.set_thresholds([{} for _ in range(n)])
    assert torch.equal(chain.hidden_from(0, xs[0], cache), whole)  # probes leave no threshold
