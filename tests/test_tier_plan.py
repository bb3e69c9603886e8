"""The GPU tier in its formats through the engine: every format runs (on the CPU, the code
CUDA runs), the plan charges the tier tensors' real bytes, a split model decodes as the
unsplit one up to a near-tie (the tiny Q4_K_M llama and the default model), and the 7B
plan and the paper-shape forecast say what the issue asks of them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from ember.models.loader import load_model, open_model
from ember.offload.body import file_blocks_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.hybrid.memory_plan import workspace_bytes
from ember.offload.hybrid.forecast import forecast
from ember.offload.hybrid.gpu_cards import CARDS
from ember.offload.hybrid.tier_dtypes import TierCaps, TierChoice, format_for_type

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
SEVEN_B = Path("/work/models-cache/llama2-7b-q4_k_m.gguf")

pytestmark = pytest.mark.skipif(not file_blocks_model.applies(),
                                reason="C++ kernels not built on this machine")


def _charges_match(engine: Engine) -> None:
    """What the plan charged for hot rows is, layer by layer, what their tensors take."""
    plan, layers = engine.hybrid.plan, engine.hybrid.layers
    for i, layer in enumerate(layers):
        assert layer.gpu_bytes() == plan.sizes.hot_bytes(i, len(layer.hot_idx))
        if layer.hot is not None:
            real = sum(t.numel() * t.element_size() for side in (layer.hot.gate_up, layer.hot.down)
                       for t in side.tensors.values())
            assert real == layer.gpu_bytes()
    assert plan.charges()["ffn_hot"] == sum(layer.gpu_bytes() for layer in layers)
    assert plan.gpu_bytes <= plan.budget


@pytest.mark.parametrize("tier", ["auto", "int4", "int8", "fp16", "bf16", "fp32"])
def test_each_tier_format_runs_charged_exactly_and_decodes_as_the_dense_model(tiny_q4_k_m,
                                                                               tier):
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)),
                                  PROMPT, 8)
    budget = workspace_bytes(loaded.config) + 400_000  # some layers' rows hot, not all
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, tier_attention="host",
                                          gpu_budget=budget,
                                          tier_dtype=tier))
    try:
        report = engine.hybrid_report()
        assert 0 < report["hot_fraction"] < 1
        want_formats = ({"file"}, {"file"}) if tier == "auto" else ({tier}, {tier})
        got = report["gpu_ffn_formats"]
        assert (set(got["gate_up"]["formats"]), set(got["down"]["formats"])) == want_formats
        _charges_match(engine)
        got_tokens, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got_tokens)
        # Per layer, per decode token: the hot side, the cold side and the caller's wait.
        timing = engine.hybrid_report()["layer_timing_ms"]
        assert all(t is not None and t["hot"] > 0 and t["cold"] > 0 for t in timing)
    finally:
        engine.close()


def test_the_default_model_split_decodes_as_unsplit_until_a_near_tie(default_greedy_reference):
    loaded, ids, want, gaps = default_greedy_reference
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=256, threads=2,
                                          tier_attention="host",
                                          gpu_budget=workspace_bytes(loaded.config) + (8 << 20)))
    try:
        report = engine.hybrid_report()
        assert 0 < report["hot_fraction"] < 1
        # Q4_K / Q5_0 / Q6_K / Q8_0 rows: the file's own blocks, its values
        assert set(report["gpu_ffn_formats"]["gate_up"]["formats"]) == {"file"}
        assert report["gpu_ffn_formats"]["down"]["error_max"] == 0
        _charges_match(engine)
        got, _ = greedy_with_gaps(engine, ids, 12)
        assert_agrees_until_near_tie(want, gaps, got)
    finally:
        engine.close()


def test_auto_formats_follow_the_file_type_and_the_device():
    sm80, old = TierCaps(True, torch.bfloat16), TierCaps(False, torch.float16)
    assert [format_for_type(t, sm80) for t in ("Q4_K", "Q4_0", "Q3_K", "Q6_K", "Q8_0", "F16",
                                               "BF16", "F32", None)] == \
        ["int4", "int4", "int4", "int8", "int8", "fp16", "bf16", "fp16", "fp32"]
    assert [format_for_type(t, old) for t in ("Q4_K", "BF16")] == ["int8", "fp16"]
    # auto and file: the file's own blocks, whatever the device; float rows (the float32
    # reference's) by type as above
    for choice in ("auto", "file"):
        assert TierChoice(choice, sm80).formats(["Q4_K", "Q6_K"], "Q4_K") == \
            ("file:Q4_K,Q6_K", "file:Q4_K")
    assert TierChoice("auto", sm80).formats([None, None], None) == ("fp32", "fp32")
    assert TierChoice("fp32", sm80).formats(["Q4_K"], "Q6_K") == ("fp32", "fp32")


@pytest.mark.skipif(not SEVEN_B.is_file(), reason="no 7B-shaped file")
def test_the_7b_plan_holds_3x_the_float32_plans_ffn_parameters():
    from ember.app.commands.info import _gpu_plan

    source = open_model(SEVEN_B)

    def plan(tier):
        # attention on the host: the plan of FFN rows in their tier formats
        args = argparse.Namespace(gpu_budget="4GiB", ctx_size=4096, split="auto",
                                  tier_dtype=tier, tier_attention="host", device="cpu")
        return _gpu_plan(source.config, args, min(4096, source.config.context_length), source)

    quantized, float32 = plan("auto"), plan("fp32")
    assert quantized.gpu_bytes <= 4 << 30 and float32.gpu_bytes <= 4 << 30
    assert quantized.hot_parameters >= 3 * float32.hot_parameters
    # gate/up on the tier in the file's own Q4_K blocks, as stored
    assert quantized.format_counts()["gate_up"] == {"file:Q4_K,Q4_K": 32}


@pytest.mark.slow
def test_the_70b_forecast_puts_both_plans_side_by_side():
    r = forecast("llama2-70b", "Q4_K_M", 24 << 30)
    ember, layers = r["ember_plan"], r["whole_layer_offload"]
    assert 0 < layers["gpu_layers"] < 80 and layers["gpu_bytes"] <= 24 << 30
    assert 0 < ember["hot_fraction"] < 1 and ember["gpu_bytes"] <= 24 << 30
    assert ember["ms_per_token"] > 0 and layers["ms_per_token"] > 0
    assert sum(ember["layer_modes"].values()) == 80 and ember["host_weight_bytes_per_token"] > 0
    bigger = forecast("llama2-70b", "Q4_K_M", 24 << 30, card=CARDS["rtx4090"])
    assert bigger["whole_layer_offload"]["ms_per_token"] < layers["ms_per_token"]
    assert bigger["ember_plan"]["ms_per_token"] < ember["ms_per_token"]


def _kv_devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _kv_devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_kv_pool_swaps_out_and_back_bit_for_bit(tiny_q4_k_m, device, dtype):
    """K/V in fp16 or bf16 on the tier's device (pinned host pool on CUDA): every written
    row comes back from host RAM with the same bits."""
    from ember.offload.kv.paged import PagedKVCache

    cfg = tiny_q4_k_m[0]
    cache = PagedKVCache(cfg, device_blocks=64, host_blocks=64, block_size=4, device=device,
                         dtype=dtype)
    view = cache.view(cache.allocate())
    n = 10
    view.reserve(n)
    g = torch.Generator().manual_seed(3)
    written = []
    for layer in range(cfg.n_layers):
        k, v = (torch.randn(n, cfg.n_kv_heads, cfg.head_dim, generator=g).to(dtype)
                for _ in range(2))
        view.write(layer, 0, k.to(device), v.to(device))
        written.append((k, v))
    view.commit(n)
    cache.swap_out(view.seq.id)
    cache.swap_in(view.seq.id)
    for layer, (k, v) in enumerate(written):
        got_k, got_v = view.read(layer, 0, n)
        assert got_k.dtype == dtype and torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
    assert cache.usage()["bytes_out"] == cache.usage()["bytes_in"] > 0


def test_info_states_the_conversion_error_the_engine_measures(tiny_q4_k_m):
    """`ember info`'s sampled error (64 rows of three layers, no model loaded) is the error
    the engine measures over every row it packs, to sampling."""
    from ember.offload.hybrid.tier_dtypes import sampled_errors

    loaded = load_model(tiny_q4_k_m[2])
    cfg = loaded.config
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=1 << 30,
                                          tier_dtype="int8", tier_attention="host"))
    try:
        measured = engine.hybrid_report()["gpu_ffn_formats"]
        assert engine.hybrid_report()["hot_fraction"] == 1.0
        sampled = sampled_errors(loaded.source.weights, cfg.n_layers, cfg.gated,
                                 list(engine.hybrid.plan.sizes.formats), torch.bfloat16)
    finally:
        engine.close()
    for kind in ("gate_up", "down"):
        assert 0 < sampled[kind] < 0.05
        assert 0.5 < sampled[kind] / measured[kind]["error_max"] < 2.0, (kind, sampled, measured)
