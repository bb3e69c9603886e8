"""The OpenAI sampling fields end to end on tiny models: logprobs equal to a float64 forward
pass of the model, the penalties and logit bias applied, all of it lossless under speculation
and reported by `ember generate --json`."""

from __future__ import annotations

import json

import pytest
import torch

from ember.models.loader import load_model
from ember.offload.decode.events import TokenEvent
from ember.offload.options.sampling import SamplingParams
from ember.offload.runtime.engine import Engine, EngineOptions

from .reference_impl import reference_logits

PROMPT = "the cat is in the hat and the dog"


def _engine(path, **kw) -> Engine:
    return Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, weights="fp32", **kw))


def _events(engine, ids, sampling, n=12):
    return [e for e in engine.stream(ids, sampling=sampling, max_tokens=n, ignore_eos=True)
            if isinstance(e, TokenEvent) and e.token_id is not None]


@pytest.mark.parametrize("name", ["gemma3", "llama-silu_glu"])
def test_logprobs_equal_a_float64_reference(tiny_models, name):
    cfg, weights, path, _ = tiny_models[name]
    engine = _engine(path)
    ids = engine.encode(PROMPT)
    sampling = SamplingParams(temperature=0.9, seed=5, logprobs=5, logit_bias=((7, 2.0),))
    events = _events(engine, ids, sampling)
    tokens = [e.token_id for e in events]
    logits = reference_logits(cfg, weights, ids + tokens)[len(ids) - 1:-1]  # float64
    logits[:, 7] += 2.0
    reference = torch.log_softmax(logits[:, :engine.tokenizer.vocab_size], -1)
    for row, event in zip(reference, events):
        assert event.logprob.logprob == pytest.approx(float(row[event.token_id]), abs=2e-4)
        fifth = float(row.topk(5).values[-1])
        assert len(event.logprob.top) == 5
        for i, lp in event.logprob.top:  # the five likeliest (up to float32 near-ties)
            assert lp == pytest.approx(float(row[i]), abs=2e-4) and lp >= fifth - 2e-4


@pytest.mark.parametrize("mode", ["self", "lookup"])
def test_penalties_bias_and_logprobs_are_lossless_under_speculation(tiny_models, mode):
    path = tiny_models["gemma3"][2]
    plain, spec = _engine(path), _engine(path, speculate=mode, tree="2,1,1")
    ids = plain.encode(PROMPT)
    for sampling in (SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3,
                                    logit_bias=((5, 1.0),), logprobs=2),
                     SamplingParams(temperature=1.0, seed=11, frequency_penalty=-0.5,
                                    logprobs=1)):
        a, b = _events(plain, ids, sampling, 30), _events(spec, ids, sampling, 30)
        assert [e.token_id for e in a] == [e.token_id for e in b]
        for x, y in zip(a, b):
            assert [i for i, _ in x.logprob.top] == [i for i, _ in y.logprob.top]
            assert [v for _, v in x.logprob.top] == pytest.approx(
                [v for _, v in y.logprob.top], abs=1e-4)
            assert x.logprob.logprob == pytest.approx(y.logprob.logprob, abs=1e-4)


def test_penalties_change_the_greedy_reply(tiny_models):
    engine = _engine(tiny_models["gemma3"][2])
    ids = engine.encode(PROMPT)
    plain = [e.token_id for e in _events(engine, ids, SamplingParams(temperature=0), 30)]
    penalized = [e.token_id for e in _events(
        engine, ids, SamplingParams(temperature=0, frequency_penalty=2.0), 30)]
    assert plain != penalized
    assert max(map(penalized.count, penalized)) <= max(map(plain.count, plain))


def test_generate_json_reports_the_engines_logprobs(tiny_models, capsys):
    from ember.app.cli import main

    path = tiny_models["gemma3"][2]
    assert main(["generate", PROMPT, "--model", str(path), "--json", "--temperature", "0",
                 "--max-tokens", "5", "--ignore-eos", "--weights", "fp32", "--logprobs", "3",
                 "--ctx-size", "128", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    engine = _engine(path)
    events = _events(engine, engine.encode(PROMPT), SamplingParams(temperature=0, logprobs=3), 5)
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    assert [e["logprob"] for e in out["logprobs"]] == pytest.approx(
        [e.logprob.logprob for e in events], abs=1e-6)
    assert all(len(e["top"]) == 3 for e in out["logprobs"])
