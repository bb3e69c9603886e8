"""A decoded token through the tier's layers from fixed inputs (offload/body/tier_graph.py):
what a CUDA graph replays. On the CPU the fixed-input step runs without a graph, its layer
steps in Triton's interpreter: its logits are the layers' own, bit for bit, token after token,
across new KV blocks, sliding windows, a second conversation and a truncation. The graph
itself is checked on CUDA (tests/test_cuda_tier.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ember.kernels import tier_layer_triton
from ember.models.loader import load_model
from ember.offload.body import file_blocks_model, tier_graph
from ember.offload.runtime.engine import Engine

from .test_tier_placement import _budgets, _options

if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
    pytest.skip("the layer steps run in Triton's interpreter, on a machine without CUDA "
                "(tests/conftest.py); tests/test_cuda_tier.py replays the graph on CUDA",
                allow_module_level=True)
pytestmark = pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("EMBER_TIER_TRITON", "cpu")
    # The interpreter runs each program in turn: attention over 2 stretches of the keys, not
    # 16, keeps these passes short (the 16 are tested in tests/test_tier_layer_triton.py;
    # what is checked here does not depend on them)
    monkeypatch.setattr(tier_layer_triton, "ATTEND_SPLITS", 2)


def _engine(loaded, budget, graphed: bool, monkeypatch, fmt: str = "bf16") -> Engine:
    monkeypatch.setattr(tier_graph, "wanted", lambda device: graphed)
    return Engine(loaded, _options(fmt, budget, 64))


def _logits(engine: Engine, session: str, prompt: list[int], n: int) -> list[torch.Tensor]:
    """The prompt's logits, then n greedy tokens' (the runner's decode steps)."""
    out = [engine.runner.prefill(session, list(prompt))]
    for _ in range(n):
        out.append(engine.runner.decode(session, int(out[-1].argmax())))
    return out


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_a_fixed_input_step_gives_the_layers_bits(model, tiny_q4_k_m, tiny_gemma_gguf,
                                                  monkeypatch):
    """The whole model on the tier; gemma3 has windows of 8 (spans that start past 0) and
    two rotary bases (and a head dim a bfloat16 pool cannot take: fp16); 8 tokens after the
    12-token prompt cross into a new KV block (16 positions each)."""
    loaded = load_model(tiny_q4_k_m[2] if model == "llama" else tiny_gemma_gguf)
    fmt = "bf16" if model == "llama" else "fp16"
    fits = _budgets(loaded, fmt, 64)["fits"]
    plain = _engine(loaded, fits, False, monkeypatch, fmt)
    graphed = _engine(loaded, fits, True, monkeypatch, fmt)
    try:
        assert plain.model.decode_graphs() is None
        report = graphed.model.decode_graphs()
        assert report["layers"] == [list(range(loaded.config.n_layers))]
        assert report["captured"] == [False]  # no CUDA: the fixed inputs, eagerly
        # "a" again: the prompt prefix kept, what followed it cut off (a truncation)
        for session, prompt in (("a", PROMPT), ("b", PROMPT[:5]), ("a", PROMPT)):
            want = _logits(plain, session, prompt, 8)
            got = _logits(graphed, session, prompt, 8)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        plain.close()
        graphed.close()


def test_split_layers_are_not_graphed(tiny_q4_k_m, monkeypatch):
    """A layer with neurons on the host (its cold side) runs as it is; only whole tier layers
    join a stretch."""
    loaded = load_model(tiny_q4_k_m[2])
    engine = _engine(loaded, _budgets(loaded, "bf16", 64)["half"], True, monkeypatch)
    try:
        modes = engine.hybrid_report()["layer_modes"]
        report = engine.model.decode_graphs()
        graphed = [i for stretch in (report or {"layers": []})["layers"] for i in stretch]
        assert graphed == [i for i, m in enumerate(modes) if m == "gpu"]
        assert "split" in modes
    finally:
        engine.close()


def test_a_step_that_cannot_be_captured_runs_as_it_is_with_one_warning(
        tiny_q4_k_m, monkeypatch, caplog):
    """A capture that fails (a kernel or a copy a graph cannot hold) costs speed, not the
    token: one warning, then the layers run as they are, with the same logits."""
    loaded = load_model(tiny_q4_k_m[2])
    fits = _budgets(loaded, "bf16", 64)["fits"]
    plain = _engine(loaded, fits, False, monkeypatch)
    graphed = _engine(loaded, fits, True, monkeypatch)
    stretch = next(s for s in graphed.model._segments if isinstance(s, tier_graph.GraphedTierRuns))
    stretch.capture = True  # as on CUDA; the capture itself refuses

    class Refused:
        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

        def __exit__(self, *exc):
            return False

    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: Refused())
    try:
        with caplog.at_level("WARNING", logger="ember.offload"):
            got = _logits(graphed, "a", PROMPT, 3)
        want = _logits(plain, "a", PROMPT, 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        warned = [r.getMessage() for r in caplog.records if "not graphed" in r.getMessage()]
        assert len(warned) == 1 and "not permitted" in warned[0] and "more" not in warned[0]
        assert not stretch.capture and graphed.model.decode_graphs()["captured"] == [False]
    finally:
        plain.close()
        graphed.close()
