"""The forecast of issue 30: the cards table, llama.cpp's layer-offload line pinned (and deaf
to Ember's planner), and Ember's whole-model plan against it in the 15 cells of the must-show."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.models.support.errors import ConfigError
from ember.offload.hybrid import decode_costs, forecast as forecast_module
from ember.offload.hybrid.forecast import ember_plan, forecast, synthetic_frequencies
from ember.offload.hybrid.gpu_cards import (CARDS, card, card_for_budget, check_budget,
                                            cpu_card, device_card)
from ember.offload.hybrid.llama_offload import llama_cpp_offload
from ember.offload.hybrid.paper_shapes import SHAPES, measured_host_gbps, model_bytes

GIB = 1 << 30


def test_the_cards_table_holds_the_documented_figures():
    want = {"rtx3060": (12, 360.0, 4, 16), "rtx4060": (8, 272.0, 4, 8),
            "rtx4070": (12, 504.2, 4, 16), "rtx3090": (24, 936.2, 4, 16),
            "rtx4090": (24, 1008.0, 4, 16), "rtx4060ti-16": (16, 288.0, 4, 8)}
    got = {n: (c.memory // GIB, c.gbps, c.pcie_gen, c.pcie_lanes) for n, c in CARDS.items()}
    assert got == want
    assert CARDS["rtx4090"].link_gbps == pytest.approx(31.5, abs=0.1)  # PCIe 4.0 x16


def test_each_budget_gets_a_card_with_that_much_memory():
    assert [card_for_budget(b * GIB).name for b in (4, 8, 12, 16, 24)] == \
        ["rtx4060", "rtx4060", "rtx3060", "rtx4060ti-16", "rtx3090"]
    assert card("RTX 4090") is CARDS["rtx4090"] and card("rtx4060ti-16").memory == 16 * GIB
    with pytest.raises(ConfigError, match="unknown --gpu"):
        card("voodoo2")
    with pytest.raises(ConfigError, match="rtx4060's 8 GiB"):
        check_budget(CARDS["rtx4060"], 12 * GIB)
    with pytest.raises(ConfigError, match="no card"):
        card_for_budget(80 * GIB)


def test_a_device_reports_its_own_figures():
    """What `torch.cuda.get_device_properties` gives: the memory clock (kHz, double data
    rate) and bus width make the bandwidth; the link comes from the table by name."""
    props = SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=24 * GIB - (300 << 20),
                            memory_clock_rate=10_501_000, memory_bus_width=384)
    got = device_card(props)
    assert got.gbps == pytest.approx(1008.1, abs=0.1) and got.source == "device"
    assert (got.pcie_gen, got.pcie_lanes) == (4, 16)
    older = SimpleNamespace(name="NVIDIA GeForce RTX 3060", total_memory=12 * GIB)
    assert device_card(older).gbps == 360.0
    with pytest.raises(ConfigError, match="--gpu"):
        device_card(SimpleNamespace(name="Some Accelerator", total_memory=GIB))
    cpu = cpu_card(40e9, 16 * GIB)
    assert cpu.read_gbps == 40.0 and cpu.link_gbps == float("inf")


# (shape, budget GiB) -> llama.cpp's -ngl layers and ms/token on the cell's card: fixed first
LLAMA_CPP_LINE = {("llama2-7b", 4): (21, 80.03), ("llama2-7b", 8): (32, 25.899),
                  ("llama2-13b", 8): (30, 121.50), ("llama2-13b", 24): (40, 14.695),
                  ("llama2-70b", 12): (23, 1077.17), ("llama2-70b", 24): (48, 625.68)}


@pytest.mark.parametrize("cell", sorted(LLAMA_CPP_LINE))
def test_the_llama_cpp_line_is_pinned(cell):
    shape, gib = cell
    got = llama_cpp_offload(SHAPES[shape], "Q4_K_M", card_for_budget(gib * GIB), gib * GIB, 4096)
    layers, ms = LLAMA_CPP_LINE[cell]
    assert got["gpu_layers"] == layers and got["ms_per_token"] == pytest.approx(ms, abs=0.01)
    assert got["gpu_bytes"] <= gib * GIB
    assert got["host_gbps"] == pytest.approx(measured_host_gbps("llama.cpp"), abs=0.01)


def test_the_llama_cpp_line_does_not_move_with_embers_planner(monkeypatch):
    s, budget = SHAPES["llama2-13b"], 8 * GIB
    before = llama_cpp_offload(s, "Q4_K_M", CARDS["rtx4060"], budget, 4096)
    for name in ("GRAPH_LAUNCH_MS", "EAGER_LAUNCH_MS", "HANDOFF_MS", "HOST_LAYER_MS"):
        monkeypatch.setattr(decode_costs, name, getattr(decode_costs, name) * 10)
    monkeypatch.setattr(forecast_module, "solve_layers", None)
    assert llama_cpp_offload(s, "Q4_K_M", CARDS["rtx4060"], budget, 4096) == before


CELLS = [(shape, gib) for shape in ("llama2-7b", "llama2-13b", "llama2-70b")
         for gib in (4, 8, 12, 16, 24)]


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_embers_dense_plan_never_loses_to_layer_offload(cell):
    """In the file's bytes, at least 1.0x llama.cpp in every cell (even with the host at
    llama.cpp's measured rate); where the model and its KV fit, all of it on the tier."""
    shape, gib = cell
    s, budget = SHAPES[shape], gib * GIB
    c = card_for_budget(budget)
    rival = llama_cpp_offload(s, "Q4_K_M", c, budget, 4096)["ms_per_token"]
    ours = ember_plan(s, "Q4_K_M", c, budget, 4096)
    same_host = ember_plan(s, "Q4_K_M", c, budget, 4096, host="llama.cpp")
    assert ours["gpu_bytes"] <= budget
    assert rival / ours["ms_per_token"] >= 1.0 and rival / same_host["ms_per_token"] >= 0.999
    model = model_bytes(s, "Q4_K_M", 4096)
    fits = sum(l.attention + l.kv + l.ffn for l in model.layers) + model.head \
        <= budget - forecast_module.workspace(s)
    if fits:
        assert ours["layer_modes"]["gpu"] == s.layers and ours["lm_head_on_gpu"]
        assert ours["host_weight_bytes_per_token"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("gib", [12, 16, 24])
def test_relu_level_sparsity_pays_twice_at_70b(gib):
    s, budget = SHAPES["llama2-70b"], gib * GIB
    c = card_for_budget(budget)
    rival = llama_cpp_offload(s, "Q4_K_M", c, budget, 4096)["ms_per_token"]
    sparse = ember_plan(s, "Q4_K_M", c, budget, 4096,
                        activity=synthetic_frequencies(s.layers, s.ffn))
    assert rival / sparse["ms_per_token"] >= 2.0


def test_the_forecast_report_names_its_card_and_its_assumptions():
    r = forecast("llama2-7b", "Q4_K_M", 24 * GIB)
    assert r["card"]["name"] == "rtx3090" and r["model_and_kv_fit"]
    assert r["ember_plan"]["layer_modes"] == {"gpu": 32, "split": 0, "cpu": 0}
    assert r["assumptions"]["cuda_graphs"] is True
    # eager launches (about 15 kernels a layer at 7.5 us) cost the 7B about 2.6 ms a token
    assert r["ember_plan_eager_ms_per_token"] - r["ember_plan"]["ms_per_token"] == \
        pytest.approx(32 * 15 * (0.0075 - 0.002) + 2 * (0.0075 - 0.002), abs=0.01)
    named = forecast("llama2-7b", "Q4_K_M", 24 * GIB, card=CARDS["rtx4090"])
    assert named["ember_plan"]["ms_per_token"] < r["ember_plan"]["ms_per_token"]
    with pytest.raises(ConfigError, match="rtx4060's 8 GiB"):
        forecast("llama2-7b", "Q4_K_M", 12 * GIB, card=CARDS["rtx4060"])
