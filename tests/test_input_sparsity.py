"""Input thresholds at run time (offload/body/input_sparsity.py) and their calibration
(offload/profile/input_calibration.py) on tiny models: the thresholded C++ step against the masked
dense reference, bit for bit; counters; allocation; the profile and engine round trip."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import block_matmul as bm
from ember.kernels import input_sparse as isp
from ember.models.reference_cache import ContiguousKVCache
from ember.models.loader import load_model
from ember.offload.body import file_blocks_model
from ember.offload.profile.input_calibration import (SlotStats, allocate, collect_slot_stats,
                                             reference_passes)
from ember.offload.body.input_sparsity import (MATMULS, SLOTS, apply_input_sparsity,
                                                check_thresholds, slot_weights)
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.models.support.errors import ConfigError

needs_native = pytest.mark.skipif(not file_blocks_model.applies(),
                                  reason="C++ kernels not built on this machine")
PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


def thresholds_for(model, value: float, slots=SLOTS) -> list[dict]:
    return [{s: value for s in slots} for _ in model.layers]


def masked_reference(runtime):
    """matmul(i, slot, x, weights) of the masked dense reference: a thresholded slot's input
    with every |x| <= threshold zeroed, multiplied densely over the same input-major layout."""
    def matmul(i, slot, x, weights):
        thr = runtime.thresholds[i].get(slot)
        if thr is None:
            return bm.block_matmul(x, weights)
        masked = torch.where(x.abs() > thr, x, torch.zeros_like(x))
        return isp.input_sparse_matmul(masked.contiguous(), runtime.layouts[(i, slot)])
    return matmul


def run(model, ids: list[int], decode: int = 4) -> list[torch.Tensor]:
    """Hidden states of a prefill of `ids` and of `decode` greedy single-row steps."""
    cache = ContiguousKVCache(model.cfg, 64, dtype=model.kv_dtype)
    out = [model.hidden(torch.tensor(ids), cache)]
    for _ in range(decode):
        tok = int(model.logits(out[-1][-1:]).argmax())
        out.append(model.hidden(torch.tensor([tok]), cache))
    return out


@needs_native
@pytest.mark.parametrize("name", ["llama-silu_glu", "gemma3"])
def test_thresholded_step_matches_masked_dense_reference_exactly(tiny_models, name):
    model = FileBlocksModel.plain(load_model(tiny_models[name][2]).source)
    runtime = apply_input_sparsity(model, thresholds_for(model, 0.4))
    got = run(model, PROMPT)
    with reference_passes(model, masked_reference(runtime)):
        want = run(model, PROMPT)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    realized = runtime.realized()
    assert 0.05 < realized["mean_thresholded"] < 0.95
    weighted = [sum(MATMULS[k] * v for k, v in row.items()) / 7 for row in realized["per_layer"]]
    assert realized["mean_body"] == pytest.approx(sum(weighted) / len(weighted), abs=1e-3)


@needs_native
def test_thresholds_change_the_output_and_zero_thresholds_nearly_do_not(tiny_models):
    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    dense = run(model, PROMPT, decode=0)[0]
    runtime = apply_input_sparsity(model, thresholds_for(model, 0.0))
    # threshold 0 keeps every nonzero input: the tiles hold the file's values, and only the
    # dense kernel's int8 rounding of x differs
    near = run(model, PROMPT, decode=0)[0]
    assert (near - dense).abs().max() < 0.05 * dense.abs().max()
    runtime.set_thresholds(thresholds_for(model, 1.0))
    far = run(model, PROMPT, decode=0)[0]
    assert not torch.allclose(far, dense, atol=1e-3)
    runtime.set_thresholds([{} for _ in model.layers])  # every slot back on the file
    assert torch.equal(run(model, PROMPT, decode=0)[0], dense)


@needs_native
def test_counters_count_what_the_kernel_kept(tiny_models):
    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    runtime = apply_input_sparsity(model, thresholds_for(model, 0.5, slots=("down",)))
    seen = {}

    def watch(i, slot, x, weights):
        if slot == "down":
            seen[i] = seen.get(i, 0) + int((x.abs() > 0.5).sum())
        return masked_reference(runtime)(i, slot, x, weights)

    run(model, PROMPT, decode=0)
    kept = {i: int(runtime.stats[(i, "down")][0]) for i in range(len(model.layers))}
    with reference_passes(model, watch):
        run(model, PROMPT, decode=0)
    assert kept == seen
    realized = runtime.realized()
    assert all(row["qkv"] == 0 for row in realized["per_layer"])
    dense_bytes, read = runtime.bytes_per_token()
    assert read < dense_bytes


def test_check_thresholds_rejects_bad_values():
    with pytest.raises(ConfigError, match="list of 2 layers"):
        check_thresholds([{}], 2)
    with pytest.raises(ConfigError, match="slots"):
        check_thresholds([{"up": 1.0}], 1)
    with pytest.raises(ConfigError, match="finite number"):
        check_thresholds([{"down": -1.0}], 1)
    assert check_thresholds([{"down": 1}], 1) == [{"down": 1.0}]


def _stats(scales: dict[str, float]) -> dict:
    g = torch.Generator().manual_seed(0)
    return {(0, s): SlotStats(torch.randn(64, 32, generator=g).abs() * v, torch.ones(32))
            for s, v in scales.items()}


def test_allocation_reaches_the_target_and_prefers_cheap_slots():
    stats = _stats({s: 1.0 for s in SLOTS})
    # one slot's inputs are spread much wider: dropping its small ones costs less energy
    g = torch.Generator().manual_seed(1)
    stats[(0, "down")] = SlotStats(torch.randn(64, 32, generator=g).abs().pow(4), torch.ones(32))
    alloc = allocate(stats, 1, 0.4)
    assert alloc.mean_sparsity() >= 0.4 - 1e-9
    assert alloc.levels[0]["down"] >= max(alloc.levels[0][s] for s in ("o",))
    assert set(alloc.thresholds[0]) == {s for s in SLOTS if alloc.levels[0][s] > 0}
    assert allocate(stats, 1, 0.0).thresholds == [{}]


def test_slot_stats_threshold_and_error():
    st = SlotStats(torch.arange(1, 101, dtype=torch.float32).reshape(1, 100), torch.ones(100))
    assert st.threshold(0.3) == 30.0
    assert st.error(0.0) == 0.0
    assert st.error(0.3) == pytest.approx(sum(i * i for i in range(1, 31))
                                          / sum(i * i for i in range(1, 101)))


@needs_native
def test_collect_slot_stats_covers_every_slot(tiny_models):
    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    stats = collect_slot_stats(model, PROMPT * 3, 2, 16)
    assert set(stats) == {(i, s) for i in range(len(model.layers)) for s in SLOTS}
    assert stats[(0, "down")].sample.shape[1] == model.cfg.ffn_size
    assert stats[(0, "qkv")].col_energy.shape == (model.cfg.hidden_size,)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from pathlib import Path

    src = Path(__file__).parent / "data" / "english.txt"
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(src.read_text()[:2500])
    return path


@needs_native
def test_profile_then_generate_realizes_the_thresholds(capsys, tmp_path, tiny_models, text_file):
    """`ember profile` on a SwiGLU model writes input thresholds (no predictors); `generate
    --profile --json` applies them and reports the sparsity realized per layer and matmul."""
    import json

    from ember.app.cli import main
    from ember.offload.runtime.profile_file import load_profile

    path = tiny_models["llama-silu_glu"][2]
    out = tmp_path / "p.safetensors"
    code = main(["profile", "--model", str(path), "--text", str(text_file), "-o", str(out),
                 "--json", "--quality-budget", "20"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["glu"]["method"] == "input thresholds" and report["predictors"] == []
    assert set(report["stages_s"]) == {"calibration", "input statistics", "slot costs", "search",
                                       "payoff", "check"}
    quality = report["quality"]
    assert quality["meets_quality_budget"] is True
    # the perplexity ratio comes with the sparsity realized while it was measured
    assert 0 <= quality["held_out_sparsity"] <= 1
    assert (quality["held_out_sparsity"] > 0) == (report["glu"]["planned_mean_sparsity"] > 0)
    assert 0 <= quality["sparsity_by_bytes"] <= 1
    # the curve the search walked, each point as the runtime realized it on the held-out text
    # (chosen on calibration text set aside); what it calibrated on
    assert all(0 <= row["mean_body"] <= 1 and "mean_body_by_bytes" in row
               and "search_ppl_ratio" in row for row in report["glu"]["tried"])
    assert report["glu"]["search_tokens"] > 0
    assert report["calibration"]["files"] == [str(text_file)]
    loaded = load_model(path)
    profile = load_profile(out, loaded.config, loaded.source.fingerprint)
    assert len(profile.meta["input_thresholds"]) == loaded.config.n_layers
    # decode was timed per slot; the artifact lists the slots that paid on this machine
    payoff = report["glu"]["payoff"]
    assert payoff["dense_tok_s"] > 0 and set(payoff["slots"]) <= set(SLOTS)
    assert profile.meta["input_pays"] == payoff["pays"] and set(payoff["pays"]) <= set(SLOTS)
    code = main(["generate", "--model", str(path), "--profile", str(out), "--max-tokens", "4",
                 "--ffn-mode", "sparse", "--json", "the cat"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["hybrid"] is None
    realized = result["input_sparsity"]
    assert len(realized["per_layer"]) == loaded.config.n_layers
    assert set(realized["per_layer"][0]) == set(SLOTS)
    assert 0 <= realized["mean_body"] <= 1
    # by default (--ffn-mode auto) only the slots that paid are thresholded
    code = main(["generate", "--model", str(path), "--profile", str(out), "--max-tokens", "4",
                 "--json", "the cat"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(captured.out)["input_sparsity"]["per_layer"]
    assert all(v == 0 for row in rows for s, v in row.items() if s not in payoff["pays"])
    # with --ffn-mode dense the profile's thresholds are not applied
    code = main(["generate", "--model", str(path), "--profile", str(out), "--ffn-mode", "dense",
                 "--max-tokens", "2", "--json", "the cat"])
    assert code == 0 and json.loads(capsys.readouterr().out)["input_sparsity"] is None


@pytest.fixture(scope="module")
def uneven_model(tmp_path_factory):
    """A tiny SwiGLU llama whose layers 1 and 2 barely write to the residual stream (their
    output projections scaled by 1e-3): thresholding them costs almost nothing end to end,
    though each one's inputs and relative output error look just like layer 0's."""
    from ember.models.testing import synthetic

    cfg = synthetic.tiny_config("llama", "silu_glu")
    weights = synthetic.tiny_weights(cfg, seed=7)
    for i in (1, 2):
        for name in ("attn_output", "ffn_down"):
            weights[f"blk.{i}.{name}.weight"] *= 1e-3
    path = synthetic.write_gguf(tmp_path_factory.mktemp("uneven") / "m.gguf", cfg, weights)
    return FileBlocksModel.plain(load_model(path).source)


@needs_native
def test_global_allocation_beats_uniform_where_layers_differ(uneven_model):
    from ember.offload.profile.input_calibration import allocator

    model, n = uneven_model, len(uneven_model.layers)
    text = [(7 * t + 3) % 200 + 3 for t in range(240)]
    stats = collect_slot_stats(model, text, 2, 64)
    runtime = apply_input_sparsity(model, [{} for _ in range(n)])
    seg = torch.tensor([2] + text[:63])

    def log_probs():  # the whole vocabulary, the model's own pass as thresholded now
        return torch.log_softmax(model.logits(model.hidden(seg, model.new_cache(64))), -1)

    dense = log_probs()
    kls = {}
    for method in ("uniform", "block", "global"):
        alloc = allocator(method, model, runtime, stats, text, 2, 64)(0.5)
        assert alloc.mean_sparsity() >= 0.5 - 1e-9
        runtime.set_thresholds(alloc.thresholds)
        kls[method] = float((dense.exp() * (dense - log_probs())).sum(-1).mean())
        if method == "global":  # the loud layer keeps its inputs; the quiet ones give theirs
            assert sum(alloc.levels[0].values()) < min(sum(alloc.levels[i].values())
                                                       for i in (1, 2))
    assert kls["uniform"] > 0 and kls["block"] > 0
    assert kls["global"] < 0.2 * min(kls["uniform"], kls["block"])


def test_allocate_global_spends_where_the_measured_gain_is_low():
    from ember.offload.profile.input_allocation import allocate_global, cost_curve
    from ember.offload.profile.input_calibration import LEVELS, STEP

    stats = {(i, s): _stats({s: 1.0})[(0, s)] for i in range(2) for s in SLOTS}
    # the same proxy errors everywhere; layer 0's measured KL 100x layer 1's
    costs = {key: cost_curve(st, [(0.5, st.error(0.5) * (100.0 if key[0] == 0 else 1.0))],
                             LEVELS) for key, st in stats.items()}
    levels = allocate_global(costs, 2, 0.3, LEVELS, STEP)
    mean = sum(MATMULS[s] * lv[s] for lv in levels for s in SLOTS) / (2 * sum(MATMULS.values()))
    assert mean == pytest.approx(0.3, abs=STEP)
    assert all(levels[0][s] <= levels[1][s] for s in SLOTS)
    assert levels[0] != levels[1]


def test_cost_curve_passes_through_every_probe_and_never_falls():
    """Two probes: the predicted KL equals the measured one at each, follows the proxy
    error in between (gain interpolated) and beyond (gain held), and never decreases."""
    from ember.offload.profile.input_allocation import cost_curve
    from ember.offload.profile.input_calibration import LEVELS

    st = _stats({"o": 1.0})[(0, "o")]
    probed = [(0.25, 0.002), (0.5, 0.05)]  # KL rising faster than the proxy error
    curve = cost_curve(st, probed, LEVELS)
    for p, kl in probed:
        assert curve[LEVELS.index(p)] == pytest.approx(kl)
    assert curve == sorted(curve) and curve[0] == 0.0
    g25, g50 = (kl / st.error(p) for p, kl in probed)
    assert curve[LEVELS.index(0.1)] == pytest.approx(g25 * st.error(0.1))
    assert curve[LEVELS.index(0.9)] == pytest.approx(g50 * st.error(0.9))


@needs_native
def test_bench_sparsity_reports_speed_sparsity_and_bytes(capsys, tiny_q4_k_m):
    """`ember bench sparsity --json` on a Q4_K_M-style model: dense and thresholded tokens/s,
    the realized sparsity, and the bytes behind the ideal speedup (the tiles are the file's
    bytes: every matmul of the body thresholded, as many bytes as the file's body)."""
    import json

    from ember.app.cli import main

    path = str(tiny_q4_k_m[2])
    code = main(["bench", "sparsity", "--model", path, "--sparsity", "0.5", "--runs", "1",
                 "--prompt-tokens", "8", "--gen-tokens", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    half = report["thresholded"]["50%"]
    assert 0.3 < half["mean_sparsity_body"] < 0.7
    assert report["tile_bytes"] == half["body_bytes_dense"]
    assert half["body_bytes_read"] < 0.75 * half["body_bytes_dense"]
    assert half["ideal_speedup_from_bytes"] > 1.2


@needs_native
def test_a_copy_in_ram_is_never_released_under_other_readers(tiny_models):
    """Pages of a RAM copy would read as zeros to every other reader of the same loaded model
    (a second engine, the self-drafter): releasing leaves them whole, and a dense model built
    from the same source afterwards computes what it computed before."""
    source = load_model(tiny_models["llama-silu_glu"][2], in_ram=lambda s: True).source
    assert source.weights.in_ram
    dense_before = run(FileBlocksModel.plain(source), PROMPT)
    model = FileBlocksModel.plain(source)
    runtime = apply_input_sparsity(model, thresholds_for(model, 0.4))
    assert runtime.release_file_copies() == 0
    for a, b in zip(dense_before, run(FileBlocksModel.plain(source), PROMPT), strict=True):
        assert torch.equal(a, b)


@needs_native
def test_released_file_copies_leave_the_output_alone_and_stay_released(tiny_models):
    """The tiles replace the file's copies of thresholded matmuls: releasing those pages
    changes nothing a thresholded pass computes, and the slots cannot go back to dense."""
    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    runtime = apply_input_sparsity(model, thresholds_for(model, 0.4))
    before = run(model, PROMPT)
    released = runtime.release_file_copies()
    file_bytes = sum(w.nbytes for i in range(len(model.layers)) for s in SLOTS
                     for w in slot_weights(model.layers[i], s))
    assert 0.5 * file_bytes < released <= file_bytes
    for a, b in zip(before, run(model, PROMPT), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="cannot run dense again"):
        runtime.set_thresholds([{} for _ in model.layers])


def test_payoff_keeps_the_slots_that_beat_dense_and_applies_only_those():
    from types import SimpleNamespace

    from ember.offload.profile.input_payoff import decide, only
    from ember.offload.runtime.engine_model import applied_thresholds

    seconds = {"dense": [1.0, 1.1, 0.9], "qkv": [1.2, 1.3, 1.1], "gate_up": [0.8, 0.85, 0.9],
               "down": [0.99, 0.99, 0.99]}  # within the margin: not worth its quality loss
    assert decide(seconds) == ["gate_up"]
    thresholds = [{"qkv": 0.1, "gate_up": 0.2, "down": 0.3}, {"down": 0.4}]
    assert only(thresholds, ["down"]) == [{"down": 0.3}, {"down": 0.4}]
    profile = SimpleNamespace(meta={"input_thresholds": thresholds, "input_pays": ["gate_up"]})
    auto, sparse = SimpleNamespace(ffn_mode="auto"), SimpleNamespace(ffn_mode="sparse")
    assert applied_thresholds(profile, auto) == [{"gate_up": 0.2}, {}]
    assert applied_thresholds(profile, sparse) == thresholds
    del profile.meta["input_pays"]  # a profile made before the timing: every slot
    assert applied_thresholds(profile, auto) == thresholds


@needs_native
def test_thresholds_compose_with_a_gpu_tier_split(capsys, tmp_path, tiny_models, text_file):
    """`--gpu-budget` with a threshold profile (made without a budget: it places nothing hot)
    splits every layer by the budget, and each split layer's cold side takes the profile's
    down threshold: the cold neurons whose act(gate) * up is at or under it skip their down
    row, hot neurons stay whole, and decoding realizes it in the report."""
    from ember.app.cli import main
    from ember.kernels.hot_ffn import hot_ffn
    from ember.kernels.sparse_ffn import sparse_ffn_thresholded_reference
    from ember.offload.options.sampling import GREEDY
    from ember.offload.hybrid.memory_plan import workspace_bytes
    from ember.offload.runtime.engine import Engine
    from ember.offload.options.engine_options import EngineOptions
    from ember.offload.runtime.profile_file import load_profile

    path = tiny_models["llama-silu_glu"][2]
    out = tmp_path / "p.safetensors"
    assert main(["profile", "--model", str(path), "--text", str(text_file), "-o", str(out),
                 "--json", "--quality-budget", "20"]) == 0
    capsys.readouterr()
    loaded = load_model(path)
    profile = load_profile(out, loaded.config, loaded.source.fingerprint)
    assert profile.placement.total_hot_fraction() == 0
    downs = [layer.get("down") for layer in profile.meta["input_thresholds"]]
    assert any(downs), "the profile should threshold some layer's down input"
    budget = workspace_bytes(loaded.config) + 60_000  # some neurons hot, most cold
    for cold_dtype in ("int8", "file"):
        engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=128, tier_attention="host",
                                              gpu_budget=budget,
                                              profile=str(out), ffn_mode="sparse",
                                              cold_dtype=cold_dtype))
        try:
            layers = engine.hybrid.layers
            assert all(layer.hot is not None and layer.has_cold_side for layer in layers)
            assert [layer.down_threshold for layer in layers] == downs
            layer = next(layer for layer in layers if layer.down_threshold)
            if cold_dtype == "int8":  # the bundles' side against its plain reference
                x = torch.randn(3, loaded.config.hidden_size,
                                generator=torch.Generator().manual_seed(4))
                cold, kept = sparse_ffn_thresholded_reference(x, layer.cold,
                                                              layer.down_threshold)
                assert 0 < int(kept.sum()) < 3 * len(layer.cold_idx)
                torch.testing.assert_close(layer(x), hot_ffn(x, layer.hot) + cold, rtol=1e-4,
                                           atol=1e-5)
            engine.generate(engine.encode("the cat"), sampling=GREEDY, max_tokens=6,
                            ignore_eos=True)
            report = engine.hybrid_report()
            assert report["cold_down_thresholds"] == downs
            assert report["host_ffn_dtype"] == cold_dtype
            assert all(f < 1.0 for f, t in zip(report["computed_fraction_per_layer"], downs) if t)
        finally:
            engine.close()
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=128, tier_attention="host",
                                         gpu_budget=budget,
                                         profile=str(out), ffn_mode="dense"))
    try:
        assert all(layer.down_threshold is None for layer in dense.hybrid.layers)
    finally:
        dense.close()


def test_an_input_threshold_profile_splits_nothing(tmp_path, tiny_models):
    """A profile of input thresholds runs on the unsplit model: it leaves the RAM copy and
    the memory check as without a profile; a predictor profile splits (read from the
    header alone; an unreadable file says nothing and counts as splitting)."""
    from ember.models.loader import open_model
    from ember.offload.options.engine_options import EngineOptions
    from ember.offload.runtime.profile_file import Profile, thresholds_inputs
    from ember.offload.runtime.resources import gated_by_predictors, splits_ffns
    from ember.placement.layout import Placement

    source = open_model(tiny_models["llama-silu_glu"][2])
    cfg = source.config

    def profile(meta: dict, name: str):
        return Profile(source.fingerprint, cfg.name, cfg.n_layers, cfg.hidden_size,
                       cfg.ffn_size, [torch.ones(cfg.ffn_size) for _ in range(cfg.n_layers)],
                       Placement.uniform((cfg.ffn_size,) * cfg.n_layers, 0.0), {},
                       meta).save(tmp_path / name)

    inputs = profile({"input_thresholds": [{"down": 0.1}] * cfg.n_layers}, "inputs.st")
    predictors = profile({"activation_thresholds": [0.0] * cfg.n_layers}, "predictors.st")
    junk = tmp_path / "junk.st"
    junk.write_bytes(b"\xff" * 64)
    assert (thresholds_inputs(inputs), thresholds_inputs(predictors),
            thresholds_inputs(junk), thresholds_inputs(tmp_path / "none")) == \
        (True, False, None, None)
    options = EngineOptions(device="cpu", profile=str(inputs))
    assert not splits_ffns(source, options) and not gated_by_predictors(source, options)
    assert splits_ffns(source, EngineOptions(device="cpu", profile=str(inputs), gpu_budget=1 << 30))
    for path in (predictors, junk):
        options = EngineOptions(device="cpu", profile=str(path))
        assert splits_ffns(source, options) and gated_by_predictors(source, options)


@needs_native
def test_payoff_bounds_a_slot_by_the_bytes_its_thresholds_skip(tiny_models):
    """The bytes bound: each layer's slot bytes times the share of its calibration sample at
    or under its threshold, over a dense token's weight bytes (LM head included)."""
    from ember.offload.profile.input_payoff import bytes_skipped

    model = FileBlocksModel.plain(load_model(tiny_models["llama-silu_glu"][2]).source)
    stats = collect_slot_stats(model, [(5 * t + 1) % 200 + 3 for t in range(120)], 2, 64)
    n = len(model.layers)
    thresholds = [{"down": stats[(i, "down")].threshold(0.5)} for i in range(n)]
    thresholds[0]["o"] = stats[(0, "o")].threshold(0.25)
    got = bytes_skipped(model, thresholds, stats)
    total = model.weight_bytes_per_token()
    down = sum(model.layers[i].down.nbytes for i in range(n))
    assert set(got) == {"down", "o"}
    assert got["down"] == pytest.approx(0.5 * down / total, rel=0.02)
    assert got["o"] == pytest.approx(0.25 * model.layers[0].wo.nbytes / total, rel=0.05)
