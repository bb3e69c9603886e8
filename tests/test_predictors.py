"""predictors/: statistics, GLU sparsity calibration, MLP predictors, on tiny random models."""

from __future__ import annotations


import pytest
import torch

from ember.models.support.errors import ConfigError, ModelFormatError
from ember.models.testing.synthetic import tiny_config, tiny_weights
from ember.models.transformer import FeedForward, Transformer, activate
from ember.models.weights import QTensor, WeightStore
from ember.predictors.calibration_text import SEED_PROMPTS, sampled_text, split_ids
from ember.predictors.collect import collect
from ember.predictors.glu_calibration import CalibrationOptions, calibrate_glu
from ember.predictors.mlp import Predictor, PredictorSet
from ember.predictors.train import TrainOptions, evaluate, train_predictors

BOS = 2


def tiny_model(seed: int = 0, **kw) -> Transformer:
    cfg = tiny_config(**kw)
    weights = tiny_weights(cfg, seed=seed)
    store = WeightStore("tiny", {n: QTensor.from_torch(t) for n, t in weights.items()})
    return Transformer(cfg, store)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP spinning made these
    tests ~5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def relu_model():
    return tiny_model(arch="llama", activation="relu_glu")


def _direct_habs(model: Transformer, ids: list[int], length: int) -> list[torch.Tensor]:
    """|h| per layer over the same segments, via plain forward hooks on the FeedForward modules."""
    from ember.predictors.passes import segments

    out = [[] for _ in model.blocks]

    def hook(layer):
        def record(module, inputs, _output):
            (x,) = inputs
            gate = x @ module.gate if module.gate is not None else None
            out[layer].append(activate(module.activation, gate, x @ module.up).abs()[1:])  # no BOS
        return record

    handles = [b.ffn.register_forward_hook(hook(i)) for i, b in enumerate(model.blocks)]
    try:
        cache = model.new_cache(length)
        for seg in segments(ids, length, BOS):
            cache.truncate(0)
            model.hidden(seg, cache)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(parts) for parts in out]


def test_statistics_match_direct_computation(relu_model):
    ids = random_ids(300, relu_model.cfg.vocab_size, seed=1)
    col = collect(relu_model, ids, BOS, length=64)
    direct = _direct_habs(relu_model, ids, 64)
    for stats, habs in zip(col.stats, direct):
        assert stats.tokens == habs.shape[0]
        torch.testing.assert_close(stats.frequency, (habs > 0).double().mean(0))
    # GLU-style threshold: active means |h| > threshold x the token's mean |h|.
    col = collect(relu_model, ids, BOS, thresholds=[0.7] * 3, length=64)
    for stats, habs in zip(col.stats, direct):
        expected = (habs > 0.7 * habs.mean(-1, keepdim=True)).double().mean(0)
        torch.testing.assert_close(stats.frequency, expected)


def test_collection_restores_the_model(relu_model):
    ids = random_ids(100, relu_model.cfg.vocab_size, seed=2)
    before = relu_model(torch.tensor([BOS] + ids[:20]), relu_model.new_cache(32))
    originals = [b.ffn for b in relu_model.blocks]
    collect(relu_model, ids, BOS, length=64, sparse=True, thresholds=[0.01] * 3)
    assert all(b.ffn is f and type(f) is FeedForward for b, f in zip(relu_model.blocks, originals))
    after = relu_model(torch.tensor([BOS] + ids[:20]), relu_model.new_cache(32))
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_collection_restores_the_model_on_error(relu_model):
    originals = [b.ffn for b in relu_model.blocks]
    with pytest.raises(ValueError):
        collect(relu_model, [5] * 600, BOS, length=relu_model.cfg.context_length + 1)
    with pytest.raises(ConfigError):
        collect(relu_model, [5] * 10, BOS, thresholds=[0.0])
    assert all(b.ffn is f for b, f in zip(relu_model.blocks, originals))


def test_sample_is_bounded_and_aligned(relu_model):
    cfg = relu_model.cfg
    per_token = cfg.n_layers * (2 * cfg.hidden_size + 2 * cfg.ffn_size)
    ids = random_ids(400, cfg.vocab_size, seed=3)
    col = collect(relu_model, ids, BOS, sample_bytes=50 * per_token, length=64)
    assert all(len(s) == 50 for s in col.samples)
    # The sampled |h| belong to the sampled inputs: recompute layer 0's from x.
    ffn, s = relu_model.blocks[0].ffn, col.samples[0]
    x = s.inputs()
    h = activate(ffn.activation, x @ ffn.gate, x @ ffn.up).abs()
    torch.testing.assert_close(s.habs.float(), h, rtol=5e-2, atol=5e-3)  # x kept as float16


def test_predictor_meets_recall_on_held_out_tokens(relu_model):
    cfg = relu_model.cfg
    train_ids = random_ids(2000, cfg.vocab_size, seed=4)
    held_ids = random_ids(600, cfg.vocab_size, seed=5)
    opts = TrainOptions(recall=0.9, ranks=(16, 32), epochs=10, batch=512, lr=5e-3,
                        max_cost_ratio=10.0)
    col = collect(relu_model, train_ids, BOS, length=128)
    predictors, reports = train_predictors(col, cfg, opts)
    held = collect(relu_model, held_ids, BOS, length=128)
    for layer, (p, sample, report) in enumerate(zip(predictors.predictors, held.samples, reports)):
        assert p is not None and report.rank == p.rank
        q = evaluate(p, sample.inputs(), sample.targets(0.0))
        assert q.recall >= 0.9, (layer, q)
        assert q.predicted_fraction < 1.0


def test_predictor_tensors_round_trip_and_reject_bad_shapes():
    g = torch.Generator().manual_seed(0)
    p = Predictor(torch.randn(8, 4, generator=g), torch.randn(4, generator=g),
                  torch.randn(4, 16, generator=g), torch.randn(16, generator=g), 0.25)
    q = Predictor.from_tensors(p.to_tensors("x."), hidden=8, ffn=16, prefix="x.")
    x = torch.randn(5, 8, generator=g)
    assert torch.equal(p.predict(x), q.predict(x)) and q.threshold == 0.25
    bad = p.to_tensors()
    bad["w2"] = torch.randn(4, 15)
    with pytest.raises(ModelFormatError, match="w2"):
        Predictor.from_tensors(bad, hidden=8, ffn=16)
    with pytest.raises(ModelFormatError, match="w1"):
        Predictor.from_tensors(p.to_tensors(), hidden=9, ffn=16)
    missing = p.to_tensors()
    del missing["b1"]
    with pytest.raises(ModelFormatError, match="missing"):
        Predictor.from_tensors(missing, hidden=8, ffn=16)
    s = PredictorSet([p, None], [0.0, 0.5])
    back = PredictorSet.from_tensors(s.to_tensors(), n_layers=2, hidden=8, ffn=16)
    assert back.predictors[1] is None and back.activation_thresholds == [0.0, 0.5]
    with pytest.raises(ModelFormatError, match="activation_thresholds"):
        PredictorSet.from_tensors(s.to_tensors(), n_layers=3, hidden=8, ffn=16)


def test_glu_calibration_meets_its_budget():
    model = tiny_model(arch="gemma3")  # gelu_glu
    vocab = model.cfg.vocab_size
    calib, held = random_ids(600, vocab, seed=6), random_ids(400, vocab, seed=7)
    opts = CalibrationOptions(budget=0.03, length=128, probe_tokens=256, local_tokens=256)
    result = calibrate_glu(model, collect(model, calib, BOS, length=128), calib, held, BOS, opts)
    assert result.ppl_ratio <= 1.03
    assert result.mean_sparsity > 0.2
    assert len(result.thresholds) == model.cfg.n_layers
    for layer in result.layers:
        if layer.sparsity > 0:
            assert layer.threshold > 0 and 0 < layer.held_out_sparsity < 1
    assert all(type(b.ffn) is FeedForward for b in model.blocks)
    assert 0.0 <= result.agreement <= 1.0


def test_calibration_options_are_checked():
    with pytest.raises(ConfigError, match="budget"):
        CalibrationOptions(budget=-1).validate()
    with pytest.raises(ConfigError, match="recall"):
        TrainOptions(recall=1.5).validate()


def test_sampled_text_keeps_held_out_prompts_apart():
    calls = []

    def generate(ids, n):
        calls.append(len(ids))
        return [1000 + len(calls)] * n

    def encode(text):
        return [ord(c) for c in text[:5]]

    out = sampled_text(generate, encode, tokens=22 * 10, held_out=0.2)
    assert len(calls) == len(SEED_PROMPTS) >= 20
    train_gen = {t for t in out.train if t >= 1000}
    held_gen = {t for t in out.held_out if t >= 1000}
    assert train_gen and held_gen and not train_gen & held_gen
    assert len(out.train) + len(out.held_out) == len(SEED_PROMPTS) * 15
    split = split_ids(list(range(10)), held_out=0.3)
    assert split.train == list(range(7)) and split.held_out == [7, 8, 9]
    with pytest.raises(ConfigError):
        split_ids([1, 2], held_out=1.0)
