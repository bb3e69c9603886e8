"""The profile artifact: round trip, engine loading (sparse mode), and refusing bad files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.models.support.errors import ConfigError, ModelFormatError
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.runtime.profile_file import Profile, default_profile_path, load_profile
from ember.offload.options.sampling import GREEDY
from ember.placement.layout import Placement
from ember.predictors.mlp import Predictor, PredictorSet


def _profile(loaded, threshold: float, rank: int = 8, seed: int = 0) -> Profile:
    cfg = loaded.config
    g = torch.Generator().manual_seed(seed)
    preds = [Predictor(torch.randn(cfg.hidden_size, rank, generator=g), torch.zeros(rank),
                       torch.randn(rank, cfg.ffn_size, generator=g), torch.zeros(cfg.ffn_size),
                       threshold) for _ in range(cfg.n_layers)]
    preds[0] = None  # a layer the profiler judged not worth a predictor: runs dense
    tensors = PredictorSet(preds, [0.0] * cfg.n_layers).to_tensors()
    freq = [torch.rand(cfg.ffn_size, generator=g) for _ in range(cfg.n_layers)]
    sizes = (cfg.ffn_size,) * cfg.n_layers
    order = [torch.argsort(f, descending=True).numpy() for f in freq]
    placement = Placement.from_counts(sizes, [cfg.ffn_size // 4] * cfg.n_layers, order)
    return Profile(loaded.source.fingerprint, cfg.name, cfg.n_layers, cfg.hidden_size,
                   cfg.ffn_size, freq, placement, tensors, {"note": "test"})


@pytest.fixture(scope="module")
def relu_model(tiny_models):
    return load_model(tiny_models["llama-relu_glu"][2])


def test_round_trip(tmp_path, relu_model):
    prof = _profile(relu_model, 0.0)
    path = prof.save(tmp_path / "p.safetensors")
    back = load_profile(path, relu_model.config, relu_model.source.fingerprint)
    assert back.meta == {"note": "test"} and back.model_name == prof.model_name
    for a, b in zip(prof.placement.hot, back.placement.hot):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(prof.frequency, back.frequency):
        torch.testing.assert_close(a, b)
    assert set(back.predictor_tensors) == set(prof.predictor_tensors)


def test_engine_runs_sparse_from_a_profile(tmp_path, relu_model):
    ids = relu_model.tokenizer.encode("the cat sat", add_bos=True)
    dense = Engine(relu_model, EngineOptions(device="cpu", n_ctx=64))  # the file's blocks
    want = dense.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True).token_ids
    # A predictor that says "everything is active" must compute what dense does (float32 host
    # rows against the file's blocks, which the split engine's attention also runs on: the
    # same sums up to rounding, so logits, not this random model's near-tie greedy tokens,
    # are compared)...
    every = _profile(relu_model, -1e30).save(tmp_path / "all.safetensors")
    eng = Engine(relu_model, EngineOptions(device="cpu", n_ctx=64, profile=str(every),
                                           cold_dtype="fp32"))
    try:
        got = eng.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True).token_ids
        assert eng.hybrid_report()["sparsity"] == 0.0
        torch.testing.assert_close(eng.runner.prefill("x", got), dense.runner.prefill("x", got),
                                   rtol=1e-3, atol=1e-3)
    finally:
        eng.close()
    # ...and a selective one computes fewer cold neurons (layer 0 has none: dense).
    some = _profile(relu_model, 0.5).save(tmp_path / "some.safetensors")
    eng = Engine(relu_model, EngineOptions(device="cpu", n_ctx=64, profile=str(some)))
    try:
        eng.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True)
        computed = eng.hybrid_report()["computed_fraction_per_layer"]
        assert computed[0] == 1.0 and all(c < 1.0 for c in computed[1:])
    finally:
        eng.close()
    dense_mode = Engine(relu_model, EngineOptions(device="cpu", n_ctx=64, profile=str(some),
                                                  ffn_mode="dense"))
    try:
        assert dense_mode.generate(ids, sampling=GREEDY, max_tokens=8,
                                   ignore_eos=True).token_ids == want
    finally:
        dense_mode.close()


def test_auto_profile_is_found_by_fingerprint(tmp_path, monkeypatch, relu_model):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    opts = EngineOptions(device="cpu", n_ctx=64, profile="auto")
    assert Engine(relu_model, opts).hybrid is None  # none written yet: dense
    _profile(relu_model, 0.0).save(default_profile_path(relu_model.source.fingerprint))
    eng = Engine(relu_model, opts)
    try:
        assert eng.hybrid is not None and eng.profile_path is not None
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="needs --profile"):
        EngineOptions(ffn_mode="sparse")


def test_bad_artifacts_are_clear_errors(tmp_path, relu_model, tiny_models):
    cfg, fp = relu_model.config, relu_model.source.fingerprint
    path = _profile(relu_model, 0.0).save(tmp_path / "p.safetensors")
    data = path.read_bytes()
    with pytest.raises(ConfigError, match="another model"):
        load_profile(path, cfg, "0" * 64)
    other = load_model(tiny_models["gemma3"][2])
    with pytest.raises((ConfigError, ModelFormatError)):
        load_profile(path, other.config, other.source.fingerprint)
    for name, mutated in {"truncated": data[: len(data) // 2], "empty": b"",
                          "garbage": b"\xff" * 64, "bitflip-header": _flip(data, 20)}.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(mutated)
        with pytest.raises((ModelFormatError, ConfigError)):
            load_profile(bad, cfg, fp)
    with pytest.raises(ConfigError, match="no profile"):
        load_profile(tmp_path / "missing.safetensors", cfg, fp)


def test_out_of_range_hot_index_is_refused(tmp_path, relu_model):
    from safetensors.torch import load, save

    path = _profile(relu_model, 0.0).save(tmp_path / "p.safetensors")
    raw = path.read_bytes()
    tensors = load(raw)
    n = int.from_bytes(raw[:8], "little")
    import json

    meta = json.loads(raw[8:8 + n])["__metadata__"]
    tensors["layer.1.hot"] = torch.tensor([0, 10_000], dtype=torch.int64)
    path.write_bytes(save(tensors, metadata=meta))
    with pytest.raises(ModelFormatError, match="outside"):
        load_profile(path, relu_model.config, relu_model.source.fingerprint)


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0xFF
    return bytes(b)


def test_a_bad_list_of_paying_slots_is_refused(tmp_path, relu_model):
    cfg = relu_model.config
    prof = _profile(relu_model, 0.0)
    prof.meta.update({"input_thresholds": [{"down": 0.1}] * cfg.n_layers, "input_pays": ["ffn"]})
    path = prof.save(tmp_path / "p.safetensors")
    with pytest.raises(ModelFormatError, match="input_pays"):
        load_profile(path, cfg, relu_model.source.fingerprint)
    prof.meta["input_pays"] = ["down"]
    back = load_profile(prof.save(tmp_path / "q.safetensors"), cfg, relu_model.source.fingerprint)
    assert back.meta["input_pays"] == ["down"]
