"""Hybrid FFN: any placement equals dense, the oracle on ReLU equals dense, the memory plan
holds its budget, and the two sides overlap and stop cleanly."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import numpy as np
import pytest
import torch

from ember.kernels.hot_ffn import HotFFNWeights, hot_ffn, hot_ffn_reference
from ember.kernels.sparse_ffn import SparseFFNWeights, neuron_rows_ffn
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.offload.hybrid.cpu_worker import CpuWorker
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.hybrid.ffn import HybridFFN
from ember.offload.hybrid.setup import build_hybrid, restore_dense
from ember.offload.hybrid.memory_plan import ComponentBytes, plan_memory, workspace_bytes
from ember.placement.layout import Placement

from .oracle_selector import OracleSelector

ACTS = ("relu", "relu2", "relu_glu", "drelu", "silu_glu", "gelu_glu")
BIG = 1 << 40  # a budget everything fits in


@pytest.mark.parametrize("act", ACTS)
def test_hot_ffn_matches_reference(act):
    g = torch.Generator().manual_seed(0)
    n, h = 37, 24
    gate = None if act in ("relu", "relu2") else torch.randn(n, h, generator=g)
    up, down = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    x = torch.randn(3, h, generator=g)
    w = HotFFNWeights.from_rows(gate, up, down, act)
    mask = torch.rand(3, n, generator=g) < 0.5
    for m in (None, mask):
        want = neuron_rows_ffn(x, gate, up, down, act, m)  # fp32 keeps the rows as given
        torch.testing.assert_close(hot_ffn_reference(x, w, m), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hot_ffn(x, w, m), want, rtol=1e-4, atol=1e-4)


def _placements(cfg, seed=0):
    sizes = (cfg.ffn_size,) * cfg.n_layers
    rng = np.random.default_rng(seed)
    half = [np.sort(rng.choice(cfg.ffn_size, cfg.ffn_size // 2, replace=False))
            for _ in range(cfg.n_layers)]
    mixed = [np.sort(rng.choice(cfg.ffn_size, int(f * cfg.ffn_size), replace=False))
             for f in np.linspace(0.0, 1.0, cfg.n_layers)]
    return {"all-hot": Placement.uniform(sizes, 1.0), "all-cold": Placement.uniform(sizes, 0.0),
            "random-half": Placement(sizes, tuple(half)),
            "per-layer-different": Placement(sizes, tuple(mixed))}


def _logits(model, ids):
    cache = model.new_cache(len(ids) + 1)
    hidden = model.hidden(torch.tensor(ids[:-1]), cache)  # prefill: T > 1, dense on both sides
    step = model.hidden(torch.tensor(ids[-1:]), cache)  # decode: T = 1
    return model.logits(torch.cat([hidden, step]))


@pytest.mark.parametrize("kind", ["llama-relu_glu", "gemma3", "llama-relu", "llama-drelu"])
def test_any_placement_equals_dense(tiny_models, kind):
    loaded = load_model(tiny_models[kind][2])
    model, cfg = loaded.model, loaded.config
    restore_dense(model)
    ids = loaded.tokenizer.encode("the cat sat on the mat", add_bos=True)
    want = _logits(model, ids)
    for name, placement in _placements(cfg).items():
        split = "cpu-only" if name == "all-cold" else "auto"
        hybrid = build_hybrid(model, BIG, torch.device("cpu"), 0, split, preferred=placement)
        try:
            assert [len(layer.hot_idx) for layer in hybrid.layers] == \
                   [placement.hot_count(i) for i in range(cfg.n_layers)], name
            torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=1e-4, msg=name)
        finally:
            hybrid.close()
            restore_dense(model)


def test_oracle_active_set_on_relu_equals_dense(tiny_models):
    loaded = load_model(tiny_models["llama-relu_glu"][2])
    model, cfg = loaded.model, loaded.config
    restore_dense(model)
    ids = loaded.tokenizer.encode("a dog and a cat", add_bos=True)
    cache = model.new_cache(len(ids))
    want = torch.cat([model.hidden(torch.tensor([t]), cache) for t in ids])
    placement = _placements(cfg, seed=3)["random-half"]
    hybrid = build_hybrid(model, BIG, torch.device("cpu"), 0, preferred=placement)
    try:
        for layer in hybrid.layers:
            layer.selector = OracleSelector(layer.cold)
        cache = model.new_cache(len(ids))
        got = torch.cat([model.hidden(torch.tensor([t]), cache) for t in ids])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # ReLU really skipped work: fewer cold neurons than all of them were computed.
        done = sum(layer.counters.cold_computed for layer in hybrid.layers)
        assert 0 < done < sum(len(layer.cold_idx) for layer in hybrid.layers) * len(ids)
    finally:
        hybrid.close()
        restore_dense(model)


def test_engine_with_gpu_budget_matches_dense_engine(tiny_models):
    loaded = load_model(tiny_models["gemma3"][2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=128))
    ids = dense.encode("the cat")
    from ember.offload.options.sampling import GREEDY

    want = dense.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
    budget = workspace_bytes(loaded.config) + 100_000  # attention cannot fit: FFN gets it
    hybrid = Engine(loaded, EngineOptions(device="cpu", n_ctx=128, tier_attention="host",
                                          gpu_budget=budget))
    try:
        report = hybrid.hybrid_report()
        assert not report["on_gpu_tier"]["attention_and_kv"]
        assert 0 < report["hot_fraction"] < 1 and report["gpu_bytes"] <= budget
        got = hybrid.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        assert got == want
        assert hybrid.hybrid_report()["computed_fraction_per_layer"][0] == 1.0  # dense mode
    finally:
        hybrid.close()
    again = Engine(loaded, EngineOptions(device="cpu", n_ctx=128))  # un-split on the way back
    assert again.hybrid is None
    assert again.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids == want


# -- the memory plan ----------------------------------------------------------------------

def _sizes(cfg, kv=50_000, head=400_000):
    return ComponentBytes.estimate(cfg, kv, head)


@pytest.mark.parametrize("room_kb", [14, 114, 214, 414, 714, 1214, 4214])
def test_plan_never_exceeds_budget(tiny_models, room_kb):
    """Budgets from the workspace alone to all of the tiny model and more."""
    cfg = tiny_models["gemma3"][0]
    plan = plan_memory(cfg, workspace_bytes(cfg) + room_kb * 1000, _sizes(cfg))
    assert plan.gpu_bytes <= plan.budget
    assert sum(plan.charges().values()) == plan.gpu_bytes


def test_plan_order_attention_then_head_then_ffn(tiny_models):
    cfg = tiny_models["gemma3"][0]
    sizes = _sizes(cfg)
    base = workspace_bytes(cfg)
    tight = plan_memory(cfg, base + sizes.attention + sizes.kv_pool - 1, sizes)
    assert not tight.attention_on_gpu and tight.placement.total_hot_fraction() > 0
    roomy = plan_memory(cfg, base + sizes.attention + sizes.kv_pool + sizes.lm_head + 10_000, sizes)
    assert roomy.attention_on_gpu and roomy.lm_head_on_gpu
    assert 0 < roomy.placement.total_hot_fraction() < 1
    assert plan_memory(cfg, BIG, sizes).placement.total_hot_fraction() == 1.0


def test_a_placement_with_nothing_hot_is_no_preference(tiny_models):
    """A profile made without a budget places nothing hot (input-threshold profiles always):
    with a budget at run time the FFN share is spread as with no profile, not left unused."""
    cfg = tiny_models["gemma3"][0]
    sizes = _sizes(cfg)
    budget = workspace_bytes(cfg) + 60_000
    cold = Placement.uniform((cfg.ffn_size,) * cfg.n_layers, 0.0)
    with_it = plan_memory(cfg, budget, sizes, preferred=cold).placement
    without = plan_memory(cfg, budget, sizes).placement
    assert with_it.total_hot_fraction() == without.total_hot_fraction() > 0


def test_impossible_budgets_are_clear_errors(tiny_models):
    cfg = tiny_models["gemma3"][0]
    with pytest.raises(ConfigError, match="below the minimum"):
        plan_memory(cfg, 1000, _sizes(cfg))
    with pytest.raises(ConfigError, match="gpu-only needs every FFN neuron"):
        plan_memory(cfg, workspace_bytes(cfg) + 1000, _sizes(cfg), split="gpu-only")
    assert plan_memory(cfg, BIG, _sizes(cfg), split="cpu-only").placement.total_hot_fraction() == 0
    with pytest.raises(ConfigError, match="needs --gpu-budget"):
        Engine(load_model(tiny_models["gemma3"][2]), EngineOptions(device="cpu", split="gpu-only"))
    with pytest.raises(ConfigError, match="unknown --split"):
        EngineOptions(split="half")


def test_preferred_placement_is_cut_down_hottest_first(tiny_models):
    cfg = tiny_models["llama-relu_glu"][0]
    sizes = _sizes(cfg)
    order = [np.arange(cfg.ffn_size)[::-1] for _ in range(cfg.n_layers)]  # high index = hot
    want = Placement.from_counts((cfg.ffn_size,) * cfg.n_layers, [100] * cfg.n_layers, order)
    room = workspace_bytes(cfg) + sizes.attention + sizes.kv_pool + 50 * 3 * sizes.neuron[0]
    plan = plan_memory(cfg, room, sizes, preferred=want, neuron_order=order)
    for layer in range(cfg.n_layers):
        hot = plan.placement.hot[layer]
        assert 0 < hot.size < 100 and hot.min() >= cfg.ffn_size - 100


# -- concurrency and interrupts -----------------------------------------------------------

def _big_layer(worker, hidden=512, ffn=8192):
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(ffn, hidden, generator=g), torch.randn(ffn, hidden, generator=g)
    down = torch.randn(ffn, hidden, generator=g)
    hot_n = ffn // 2
    hot = HotFFNWeights.from_rows(gate[:hot_n], up[:hot_n], down[:hot_n], "silu_glu")
    cold = SparseFFNWeights.from_rows(gate[hot_n:], up[hot_n:], down[hot_n:], "silu_glu")
    return HybridFFN(0, ffn, np.arange(hot_n), np.arange(hot_n, ffn), hot, cold, worker)


def test_cpu_and_gpu_sides_overlap(monkeypatch):
    """A rendezvous only concurrent sides can pass: the CPU side waits for the GPU-tier side
    to have started, and the GPU-tier side waits for the CPU side to have started."""
    worker = CpuWorker()
    layer = _big_layer(worker, hidden=64, ffn=256)
    cold_started, hot_started = threading.Event(), threading.Event()
    real_cold, real_hot = layer._cold_side, layer._hot_side

    def cold_side(x_host, active):
        cold_started.set()
        if not hot_started.wait(5):
            raise TimeoutError("the GPU-tier side never ran while the CPU side did")
        return real_cold(x_host, active)

    def hot_side(x, *rest):
        hot_started.set()
        if not cold_started.wait(5):
            raise TimeoutError("the CPU side never ran while the GPU-tier side did")
        return real_hot(x, *rest)

    monkeypatch.setattr(layer, "_cold_side", cold_side)
    monkeypatch.setattr(layer, "_hot_side", hot_side)
    x = torch.randn(1, 64)
    try:
        out = layer(x)
        monkeypatch.undo()
        torch.testing.assert_close(out, layer(x))
        timing = layer.counters.timing_ms()  # per decode token: both sides and the wait
        assert set(timing) == {"hot", "cold", "wait"} and timing["cold"] > 0
    finally:
        worker.close()


def test_ctrl_c_while_waiting_on_the_cpu_side_leaves_the_worker_usable(monkeypatch):
    worker = CpuWorker()
    layer = _big_layer(worker, hidden=64, ffn=256)
    x = torch.randn(1, 64)
    slow = threading.Event()

    def slow_cold(x_host, active):
        slow.set()
        time.sleep(0.3)
        return torch.zeros(1, 64)

    monkeypatch.setattr(layer, "_cold_side", slow_cold)
    # interrupt_main() does nothing unless Python's own SIGINT handler is installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=lambda: (slow.wait(2), _thread.interrupt_main()),
                         daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):
                layer(x)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    torch.testing.assert_close(layer(x), layer(x))  # the worker still serves jobs
    t0 = time.perf_counter()
    worker.close()
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


# -- the command line ---------------------------------------------------------------------

def _cli(capsys, *argv):
    from ember.app.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_with_gpu_budget_reports_the_split(capsys, tiny_gemma_gguf):
    import json

    args = ["generate", "the cat", "--model", str(tiny_gemma_gguf), "--temperature", "0",
            "--max-tokens", "6", "--json", "--ignore-eos", "--device", "cpu"]
    dense = json.loads(_cli(capsys, *args)[1])
    # (budgets: the tier's workspace, ~2.9 MB with the decode graph's, and some room)
    code, out, err = _cli(capsys, *args, "--gpu-budget", "3.15MB", "--tier-attention", "host")
    assert code == 0, err
    result = json.loads(out)
    hybrid = result["hybrid"]
    assert len(hybrid["hot_fraction_per_layer"]) == 6 and 0 < hybrid["hot_fraction"] < 1
    assert hybrid["gpu_bytes"] <= 3_150_000
    assert result["token_ids"] == dense["token_ids"] and dense["hybrid"] is None
    # What the split holds on the host: the cold side (on a GLU model, by default the
    # file's blocks), and down made neuron-major.
    assert hybrid["host_ffn_bytes"] > 0 and hybrid["host_ffn_dtype"] in ("file", "int8", "fp32")
    assert 0 < hybrid["down_neuron_major_bytes"] < hybrid["host_ffn_bytes"] + hybrid["gpu_bytes"]
    # By default the whole-model plan, priced for the card --gpu names
    code, out, err = _cli(capsys, *args, "--gpu-budget", "4.15MB", "--gpu", "rtx4090")
    assert code == 0, err
    result = json.loads(out)
    plan = result["hybrid"]
    assert len(plan["layer_modes"]) == 6 and plan["forecast"]["card"]["name"] == "rtx4090"
    assert plan["gpu_bytes"] <= 4_150_000 and result["token_ids"] == dense["token_ids"]


def test_info_prints_the_gpu_plan_and_rejects_impossible_budgets(capsys, tiny_gemma_gguf):
    code, out, _ = _cli(capsys, "info", "--model", str(tiny_gemma_gguf), "--gpu-budget", "4.15MB")
    assert code == 0 and "GPU tier budget" in out and "host weight bytes per token" in out
    # The plan of FFN rows (attention on the host): hot rows on the tier, cold ones derived
    code, out, _ = _cli(capsys, "info", "--model", str(tiny_gemma_gguf), "--gpu-budget",
                        "4.15MB", "--tier-attention", "host")
    assert code == 0 and "hot FFN neurons" in out
    assert "cold FFN rows in host RAM" in out  # derived bytes, beside the mapped file
    code, _, err = _cli(capsys, "info", "--model", str(tiny_gemma_gguf), "--gpu-budget", "10KB")
    assert code == 2 and "below the minimum" in err
    code, _, err = _cli(capsys, "generate", "x", "--model", str(tiny_gemma_gguf),
                        "--split", "gpu-only")
    assert code == 2 and "needs --gpu-budget" in err
    code, _, err = _cli(capsys, "generate", "x", "--model", str(tiny_gemma_gguf),
                        "--gpu-budget", "lots")
    assert code == 2 and "--gpu-budget" in err


def test_batched_sparse_evaluation_equals_token_by_token_decoding(tiny_models):
    """`sparse_rows` (used to measure quality) computes what per-token decoding computes."""
    from ember.offload.hybrid.neuron_selectors import PredictorSelector

    loaded = load_model(tiny_models["llama-silu_glu"][2])
    model, cfg = loaded.model, loaded.config
    restore_dense(model)
    g = torch.Generator().manual_seed(5)
    proj = [torch.randn(cfg.hidden_size, cfg.ffn_size, generator=g) for _ in range(cfg.n_layers)]
    placement = _placements(cfg, seed=4)["random-half"]
    hybrid = build_hybrid(model, BIG, torch.device("cpu"), 0, preferred=placement)
    ids = loaded.tokenizer.encode("the cat sat on a mat", add_bos=True)
    try:
        for layer, w in zip(hybrid.layers, proj):
            layer.selector = PredictorSelector(lambda x, w=w: (x @ w) > 0,
                                               torch.from_numpy(layer.cold_idx))
            layer.bias = torch.full((cfg.hidden_size,), 0.01)
            layer.sparse_rows = True
        cache = model.new_cache(len(ids))
        batched = model.hidden(torch.tensor(ids), cache)
        cache = model.new_cache(len(ids))
        stepped = torch.cat([model.hidden(torch.tensor([t]), cache) for t in ids])
        torch.testing.assert_close(batched, stepped, rtol=0, atol=1e-4)
        computed = [layer.computed_fraction() for layer in hybrid.layers]
        assert all(0.5 < c < 1.0 for c in computed)  # hot half always, about half the rest
    finally:
        hybrid.close()
        restore_dense(model)


def test_cold_rows_default_to_the_files_blocks_unless_the_body_is_float32():
    from ember.kernels import q8_matmul
    from ember.offload.hybrid.ffn import bundle_dtype
    from ember.offload.hybrid.setup import resolve_cold_dtype

    assert resolve_cold_dtype("auto", "auto") == ("file" if q8_matmul.available() else "fp32")
    assert resolve_cold_dtype("auto", "fp32") == "fp32"
    assert resolve_cold_dtype("fp32", "auto") == "fp32" and resolve_cold_dtype("int8", "fp32") == "int8"
    assert bundle_dtype("file") == "int8" and bundle_dtype("fp32") == "fp32"
    with pytest.raises(ConfigError, match="--cold-dtype file"):
        resolve_cold_dtype("file", "fp32")
