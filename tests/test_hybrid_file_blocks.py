"""The hybrid split and the sparse FFN on the file's own blocks (a Q4_K_M tiny model): rows
sliced from the GGML tensors, no float32 model built, results against the dense reference,
speculation lossless through the split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.models.reference_cache import ContiguousKVCache
from ember.models.loader import load_model
from ember.models.weights import QTensor
from ember.offload.body import file_blocks_model
from ember.offload.hybrid.cpu_worker import CpuWorker
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.body.ffn_rows import FileFFNRows, FloatFFNRows
from ember.offload.hybrid.ffn import HybridFFN
from ember.offload.hybrid.memory_plan import workspace_bytes
from ember.offload.runtime.profile_file import Profile
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.offload.body.file_layers import FileLayers
from ember.offload.body.layer_runs import LayerRun
from ember.offload.runtime.resources import builds_float_model, split_rows_bytes
from ember.offload.options.sampling import GREEDY
from ember.offload.speculative.token_tree import TokenTree
from ember.placement.layout import Placement
from ember.predictors.mlp import Predictor, PredictorSet

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not file_blocks_model.applies(),
                                reason="C++ kernels not built on this machine")


def _logits(model, ids=PROMPT) -> torch.Tensor:
    cache = ContiguousKVCache(model.cfg, 64)
    return model.logits(model.hidden(torch.tensor(ids), cache))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _greedy(engine: Engine, n: int = 8) -> list[int]:
    return engine.generate(PROMPT, sampling=GREEDY, max_tokens=n, ignore_eos=True).token_ids


def _split_budget(cfg) -> int:
    """A GPU-tier budget the plan gives to half of the FFN neurons in the file's blocks (one
    256-neuron group of 512 a layer, ~500 B a neuron; attention and its KV, ~460 kB, do not
    fit beside them): every layer has hot and cold neurons."""
    return workspace_bytes(cfg) + 420_000


def _profile(loaded, threshold: float, seed: int = 0) -> Profile:
    """Random predictors (layer 0 without one: dense), half of each layer hot (one whole
    256-neuron group, as the file's blocks take them)."""
    cfg, rank = loaded.config, 8
    g = torch.Generator().manual_seed(seed)
    preds = [Predictor(torch.randn(cfg.hidden_size, rank, generator=g), torch.zeros(rank),
                       torch.randn(rank, cfg.ffn_size, generator=g), torch.zeros(cfg.ffn_size),
                       threshold) for _ in range(cfg.n_layers)]
    preds[0] = None
    freq = [torch.rand(cfg.ffn_size, generator=g) for _ in range(cfg.n_layers)]
    order = [torch.argsort(f, descending=True).numpy() for f in freq]
    placement = Placement.from_counts((cfg.ffn_size,) * cfg.n_layers,
                                      [cfg.ffn_size // 2] * cfg.n_layers, order)
    return Profile(loaded.source.fingerprint, cfg.name, cfg.n_layers, cfg.hidden_size,
                   cfg.ffn_size, freq, placement,
                   PredictorSet(preds, [0.0] * cfg.n_layers).to_tensors(), {})


def test_file_rows_are_the_float_models_rows(tiny_q4_k_m):
    """A neuron's gate/up rows dequantized from its own blocks and its down column from the
    layer's neuron-major form are exactly the float reference's (the same blocks, decoded)."""
    loaded = load_model(tiny_q4_k_m[2])
    blocks = FileBlocksModel.plain(loaded.source)
    idx = torch.tensor([0, 5, 255, 256, 511, 3])
    for layer, float_ffn in zip(blocks.layers, (b.ffn for b in loaded.model.blocks)):
        rows = FileFFNRows(layer.gate_up, layer.down, layer.activation)
        for got, want in zip(rows.neuron_rows(idx), FloatFFNRows(float_ffn).neuron_rows(idx)):
            assert torch.equal(got, want)
        assert rows._down_nm.numel() * 4 == 512 * 256 * 4  # one layer's down, neuron-major
        rows.release()
        assert rows._down_nm is None  # the split keeps its own copies of the rows


def test_the_layer_by_layer_pass_equals_the_one_call_pass(tiny_models, tiny_q4_k_m):
    """With each layer's FFN handed back as the file's blocks run dense, the per-layer path
    (attention in C++ per layer, the FFN in between) gives the one-call pass's logits (to the
    rounding of the activation, computed in torch there), on a gemma3 file (sandwich norms,
    windows) and a K-quant llama."""
    for path in (tiny_models["gemma3"][2], tiny_q4_k_m[2]):
        whole = FileBlocksModel.plain(load_model(path).source)
        file = FileLayers.read(load_model(path).source)
        layered = FileBlocksModel(file, [LayerRun(None, rows.dense) for rows in file.ffn_rows()])
        assert not layered.batch_invariant
        torch.testing.assert_close(_logits(layered), _logits(whole), rtol=1e-5, atol=1e-5)


def test_a_split_layer_on_file_rows_equals_the_dense_ffn(tiny_q4_k_m):
    """Any hot/cold split of a layer, fp32 on both sides, adds up to the dense float FFN."""
    loaded = load_model(tiny_q4_k_m[2])
    layer = FileBlocksModel.plain(loaded.source).layers[1]
    dense = loaded.model.blocks[1].ffn
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    worker = CpuWorker()
    try:
        for hot in (np.arange(0), np.arange(0, 512, 3), np.arange(512)):
            rows = FileFFNRows(layer.gate_up, layer.down, layer.activation)
            split = HybridFFN.split(rows, 1, hot, CPU, worker, "fp32")
            torch.testing.assert_close(split(x), dense(x), rtol=1e-4, atol=1e-4)
    finally:
        worker.close()


def test_a_hybrid_split_runs_on_the_file_blocks(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    want_tokens, gaps = greedy_with_gaps(dense, PROMPT, 8)
    # The int8 bundles' cold side (the default, the file's blocks, is tests/test_file_cold.py's)
    options = EngineOptions(device="cpu", n_ctx=64, tier_attention="host",
                            gpu_budget=_split_budget(loaded.config),
                            cold_dtype="int8")
    assert not builds_float_model(loaded.source, options, CPU)
    assert split_rows_bytes(loaded.source, options, CPU) > 0  # charged by the memory check
    hybrid = Engine(loaded, options)
    try:
        assert isinstance(hybrid.model, FileBlocksModel) and hybrid.model.runs is not None
        report = hybrid.hybrid_report()
        assert 0 < report["hot_fraction"] < 1 and report["host_ffn_dtype"] == "int8"
        assert 0 < report["down_neuron_major_bytes"] < report["gpu_ffn_bytes"] + \
            report["host_ffn_bytes"]
        # Against the dense engine on the same blocks, and the float32 reference (with the
        # k-quant tolerance of test_file_blocks_model: int8 activations cost a little there).
        got = _logits(hybrid.model)
        assert _rel_err(got, _logits(dense.model)) < 0.2
        ref = _logits(loaded.model)
        assert _rel_err(got, ref) < 0.3
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
        assert_agrees_until_near_tie(want_tokens, gaps, _greedy(hybrid))
        formats = report["gpu_ffn_formats"]  # the file's own blocks: its values
        assert formats["gate_up"]["formats"] == {"file": 3}
        assert formats["down"]["formats"] == {"file": 3}
        assert formats["gate_up"]["error_max"] == 0 and formats["down"]["error_max"] == 0
        assert hybrid.hybrid_report()["computed_fraction_per_layer"] == [1.0] * 3  # dense
    finally:
        hybrid.close()
    # The float model above was built by the test for its reference, not by an engine.
    again = load_model(tiny_q4_k_m[2])
    engine = Engine(again, options)
    try:
        _greedy(engine, 2)
        assert again._model is None  # the float32 model was never built
    finally:
        engine.close()


def test_the_split_never_holds_the_whole_model_in_float(tiny_q4_k_m, monkeypatch):
    """Building a split engine dequantizes at most one layer's matrix at a time, and keeps
    no derived down once every layer is split."""
    loaded = load_model(tiny_q4_k_m[2])
    cfg = loaded.config
    largest, real = [0], QTensor.dequantize

    def watched(self):
        out = real(self)
        largest[0] = max(largest[0], out.numel())
        return out

    monkeypatch.setattr(QTensor, "dequantize", watched)
    sources = []
    real_rows = FileLayers.ffn_rows
    monkeypatch.setattr(FileLayers, "ffn_rows",
                        lambda self: sources.extend(real_rows(self)) or sources)
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64,
                                          gpu_budget=_split_budget(cfg)))
    try:
        assert largest[0] <= cfg.hidden_size * cfg.ffn_size  # one layer's down at most
        assert len(sources) == cfg.n_layers and all(s._down_nm is None for s in sources)
        assert loaded._model is None  # the float32 model was never built
    finally:
        engine.close()


def test_a_sparse_profile_runs_on_the_file_blocks(tmp_path, tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    want = _logits(dense.model)
    # Predictors that call every neuron active compute what dense does (fp32 cold rows; the
    # hot quarter float too), with a GPU tier and without one.
    every = _profile(loaded, -1e30).save(tmp_path / "every.safetensors")
    for budget in (None, _split_budget(loaded.config)):
        eng = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, profile=str(every),
                                           tier_attention="host",
                                           gpu_budget=budget, cold_dtype="fp32"))
        try:
            assert isinstance(eng.model, FileBlocksModel)
            assert eng.hybrid.layers[1].selector is not None
            if budget is None:  # nothing hot: layer 0, ungated, runs on the file's blocks
                assert eng.hybrid.layers[0].cold is None and eng.hybrid.layers[0].hot is None
                assert eng.hybrid.layers[0].dense_fallback() is not None
                assert eng.hybrid.layers[1].cold is not None
            _greedy(eng)
            assert eng.hybrid_report()["sparsity"] == 0.0
            assert _rel_err(_logits(eng.model), want) < 0.2
        finally:
            eng.close()
    # A selective one computes fewer cold neurons (layer 0 has no predictor: dense), and
    # still decodes the tokens its own T-row passes agree with.
    some = _profile(loaded, 0.5).save(tmp_path / "some.safetensors")
    for cold_dtype in ("int8", "file"):
        eng = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, profile=str(some),
                                           tier_attention="host",
                                           gpu_budget=_split_budget(loaded.config),
                                           cold_dtype=cold_dtype))
        try:
            _greedy(eng)
            computed = eng.hybrid_report()["computed_fraction_per_layer"]
            assert computed[0] == 1.0 and all(c < 1.0 for c in computed[1:])
            # Predictors gate bundles: "file" keeps the file's blocks only where none gates.
            layers = eng.hybrid.layers
            assert all(layer.selector is not None and layer.cold is not None
                       for layer in layers[1:])
            assert (layers[0].cold_file is not None) == (cold_dtype == "file")
        finally:
            eng.close()
    assert loaded._model is None  # the float32 model was never built


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_speculation_through_the_split_is_lossless(tmp_path, tiny_q4_k_m, drafter):
    """Speculative decoding on a split (and a sparse) engine gives the tokens plain greedy
    decoding on the same engine options gives."""
    loaded = load_model(tiny_q4_k_m[2])
    budget = _split_budget(loaded.config)
    some = _profile(loaded, 0.5).save(tmp_path / "some.safetensors")
    prompt = PROMPT + PROMPT[1:]  # repeats: the lookup drafter finds drafts
    for extra in ({}, {"profile": str(some)}):
        plain = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget, **extra))
        spec = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget,
                                            speculate=drafter, **extra))
        try:
            want = plain.generate(prompt, sampling=GREEDY, max_tokens=12,
                                  ignore_eos=True).token_ids
            got = spec.generate(prompt, sampling=GREEDY, max_tokens=12,
                                ignore_eos=True).token_ids
            assert got == want, extra
            assert spec.speculation["verifications"] > 0
        finally:
            plain.close()
            spec.close()
    assert loaded._model is None  # the float32 model was never built


def test_a_split_engine_leaves_another_engine_alone(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    before = _greedy(dense)
    hybrid = Engine(loaded, EngineOptions(device="cpu", n_ctx=64,
                                          gpu_budget=_split_budget(loaded.config)))
    try:
        assert dense.model.runs is None and dense.model.batch_invariant
        dense.runner.reset("default")
        assert _greedy(dense) == before
    finally:
        hybrid.close()


def test_verifying_a_chain_gives_the_logits_decoding_gives(tmp_path, tiny_q4_k_m):
    """The bit-equality lossless speculation rests on: a split, sparse engine verifies a
    drafted chain with exactly the logits decoding it token by token gives (its T-row
    passes would compute every cold neuron where a decoded row computes the predicted
    ones, so tree rows go one at a time)."""
    loaded = load_model(tiny_q4_k_m[2])
    some = _profile(loaded, 0.5).save(tmp_path / "some.safetensors")
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, profile=str(some),
                                          gpu_budget=_split_budget(loaded.config)))
    try:
        runner, chain = engine.runner, [60, 61, 62, 63, 64]
        runner.prefill("v", PROMPT)
        want = [runner.decode("v", t) for t in chain]
        runner.reset("v")
        runner.prefill("v", PROMPT)
        tree = TokenTree.root(chain[0])
        for t in chain[1:]:
            tree.add(len(tree) - 1, t)
        assert runner.begin_tree("v", len(tree)) == len(tree)
        got = runner.verify("v", tree)
        assert all(torch.equal(got[i], want[i]) for i in range(len(chain)))
    finally:
        engine.close()


def test_the_memory_check_charges_the_derived_rows_not_a_float_model(monkeypatch, tiny_q4_k_m):
    """A split engine on the file's blocks needs the file, the rows the split derives and the
    KV pools: less than the float32 model the legacy split built, and said in the error."""
    from ember.models.loader import open_model
    from ember.offload.runtime import resources

    source = open_model(tiny_q4_k_m[2])
    needs = {}

    def record(what, need, available, detail):
        needs[len(needs)] = (need, detail)

    monkeypatch.setattr(resources, "_require", record)
    budget = _split_budget(source.config)
    for weights in ("auto", "fp32"):
        resources.check_memory(source, EngineOptions(n_ctx=64, gpu_budget=budget,
                                                     weights=weights), CPU)
    (split_need, detail), (float_need, _) = needs[0], needs[1]
    assert "FFN rows the hybrid split derives" in detail
    assert split_need < float_need
    assert split_need >= source.weights.total_bytes() + split_rows_bytes(
        source, EngineOptions(gpu_budget=budget), CPU)
