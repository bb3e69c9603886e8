"""The whole-model plan of a real file, as `ember info --gpu-budget` shows it: every tensor
charged its file bytes, the whole model on the tier when it fits (no host weight reads), per
layer gpu/split/cpu when it does not, within the budget, priced for the named card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.models.support.errors import ConfigError
from ember.models.loader import open_model
from ember.offload.hybrid.gpu_cards import CARDS
from ember.offload.hybrid.layer_plan import plan_speeds
from ember.offload.hybrid.memory_plan import ComponentBytes, plan_memory, workspace_bytes

SEVEN_B = Path("/work/models-cache/llama2-7b-q4_k_m.gguf")


def _info(capsys, *argv):
    from ember.app.cli import main

    code = main(["info", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _sizes(source, n_ctx=64):
    cfg = source.config
    kv = cfg.n_layers * n_ctx * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    return ComponentBytes.of_file_blocks(cfg, source.weights, n_ctx, kv)


def test_the_plan_charges_the_files_own_bytes(tiny_q4_k_m):
    source = open_model(tiny_q4_k_m[2])
    cfg, w = source.config, source.weights
    sizes = _sizes(source)
    blocks = sum(w.get(n).nbytes for n in w.names() if n.startswith("blk."))
    ffn = sum(w.get(f"blk.{i}.ffn_{k}.weight").nbytes for i in range(cfg.n_layers)
              for k in ("gate", "up", "down"))
    assert sizes.attention == blocks - ffn
    assert sizes.lm_head == w.get("output.weight").nbytes  # what the tier's head holds
    assert [sizes.hot_bytes(i, cfg.ffn_size) for i in range(cfg.n_layers)] == \
        [sum(w.get(f"blk.{i}.ffn_{k}.weight").nbytes for k in ("gate", "up", "down"))
         for i in range(cfg.n_layers)]
    # Hot neurons come in whole blocks of down's input axis (256 for K-quants)
    lb = sizes.model.layers[0]
    assert lb.granule == 256 and lb.hot(1) == lb.gate_up + 256 * lb.down


def test_everything_on_the_tier_when_it_fits_else_per_layer_modes(tiny_q4_k_m):
    source = open_model(tiny_q4_k_m[2])
    cfg = source.config
    sizes = _sizes(source)
    whole = sum(l.attention + l.kv + l.ffn for l in sizes.model.layers) + sizes.lm_head
    space = workspace_bytes(cfg)
    roomy = plan_memory(cfg, space + whole, sizes, speeds=plan_speeds(8 << 30))
    assert roomy.layer_modes == ("gpu",) * cfg.n_layers and roomy.lm_head_on_gpu
    assert roomy.host_weight_bytes() == 0 and roomy.gpu_bytes == space + whole
    assert roomy.placement.total_hot_fraction() == 1.0
    tight = plan_memory(cfg, space + whole // 2, sizes, speeds=plan_speeds(8 << 30))
    assert tight.gpu_bytes <= space + whole // 2 and "cpu" in tight.layer_modes + (
        "cpu",) * (not tight.lm_head_on_gpu)
    assert tight.host_weight_bytes() > 0
    charges = tight.charges()
    on = tight.tier_layers()
    assert charges["attention"] == sum(sizes.model.layers[i].attention for i in on)
    assert charges["kv_pool"] == sum(sizes.model.layers[i].kv for i in on)
    for i, mode in enumerate(tight.layer_modes):
        hot = tight.placement.hot_count(i)
        assert (mode == "cpu") == (hot == 0 and i not in on)
        assert mode != "gpu" or hot == cfg.ffn_size
    assert tight.to_dict()["forecast"]["ms_per_token"] > 0 and tight.forecast["solver"] in (
        "optimal", "time_limit", "fallback")
    with pytest.raises(ConfigError, match="gpu-only needs every layer"):
        plan_memory(cfg, space + whole // 2, sizes, "gpu-only", speeds=plan_speeds(8 << 30))


def test_info_shows_the_whole_model_plan_for_a_named_card(capsys, tiny_q4_k_m):
    path = str(tiny_q4_k_m[2])
    code, out, _ = _info(capsys, "--model", path, "--gpu-budget", "64MiB", "--gpu", "rtx4060",
                         "--json")
    assert code == 0
    plan = json.loads(out)["gpu_plan"]
    assert set(plan["layer_modes"]) == {"gpu"} and plan["on_gpu_tier"]["lm_head"]
    assert plan["host_weight_bytes_per_token"] == 0
    assert plan["forecast"]["card"]["name"] == "rtx4060"
    code, out, _ = _info(capsys, "--model", path, "--gpu-budget", "64MiB", "--gpu", "rtx4090")
    assert code == 0 and "host weight bytes per token: 0 B" in out and "on rtx4090" in out
    code, _, err = _info(capsys, "--model", path, "--gpu-budget", "12GiB", "--gpu", "rtx4060")
    assert code == 2 and "rtx4060's 8 GiB" in err


@pytest.mark.skipif(not SEVEN_B.is_file(), reason="no 7B-shaped file in /work/models-cache")
def test_the_7b_at_8_gib_holds_every_part_on_the_tier(capsys):
    code, out, _ = _info(capsys, "--model", str(SEVEN_B), "--gpu-budget", "8GiB", "--gpu",
                         "rtx4060", "--json")
    assert code == 0
    plan = json.loads(out)["gpu_plan"]
    assert plan["layer_modes"] == ["gpu"] * 32 and plan["on_gpu_tier"]["lm_head"]
    assert plan["host_weight_bytes_per_token"] == 0 and plan["gpu_bytes"] <= 8 << 30
    assert plan["charges"]["kv_pool"] > 0 and plan["charges"]["attention"] > 1 << 30


def test_a_card_too_small_for_the_budget_is_refused_and_plans_name_theirs():
    speeds = plan_speeds(12 << 30)
    assert speeds.tier is CARDS["rtx3060"]
    past = plan_speeds(64 << 30)
    assert past.tier.memory == 64 << 30 and past.tier.gbps == CARDS["rtx4090"].gbps
    assert plan_speeds(4 << 30, CARDS["rtx4090"]).tier is CARDS["rtx4090"]


def test_a_named_card_wins_over_the_cuda_device_and_without_a_name_the_device_prices(
        monkeypatch):
    """`--gpu NAME` prices the plan for that card on any machine (a plan for another card,
    made on a big GPU); unnamed, the CUDA device's own properties do. The device is a
    stand-in for `torch.cuda.get_device_properties`, so this runs without CUDA."""
    import types

    import torch

    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=140 << 30,
                                  memory_clock_rate=2_619_000, memory_bus_width=6144)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda")
    assert plan_speeds(8 << 30, CARDS["rtx4060"], cuda).tier is CARDS["rtx4060"]
    own = plan_speeds(8 << 30, None, cuda).tier
    assert (own.name, own.source, own.memory) == ("NVIDIA H200", "device", 140 << 30)
