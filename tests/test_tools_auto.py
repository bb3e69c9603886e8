"""tool_choice "auto" under its lazy grammar, on the tiny Hermes-template model: free text is
left alone (the same tokens as without the grammar), a call the model begins is forced
well-formed (an offered function, arguments valid under its schema) and streams as OpenAI
streams calls (id and name first, then argument fragments); speculation stays lossless.

The tiny model never begins a call by itself: a logit bias on `<tool_call>` makes it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from starlette.testclient import TestClient  # noqa: E402

from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.tools import ToolRequest, call_grammar, token_ref  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402
from ember.models.chat_format import ChatMessage  # noqa: E402
from ember.models.loader import load_model  # noqa: E402
from ember.offload.options.sampling import SamplingParams  # noqa: E402
from ember.offload.runtime.engine import Engine, EngineOptions  # noqa: E402

from .test_chat_templates import base_vocab  # noqa: E402,F401
from .test_serve_tools import ASK, TOOLS, _valid, engine, merged_calls  # noqa: E402,F401

SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 4, "top_k": 0, "top_p": 1.0,
                                  "min_p": 0.0}]


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    worker = EngineWorker(engine)
    yield TestClient(create_app(worker, "tiny-tools"))
    worker.close()


def _call_bias(engine) -> dict:  # noqa: F811
    return {str(engine.tokenizer.id_of("<tool_call>")): 100}


def _sse(r) -> list[dict]:
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_a_call_begun_under_auto_is_valid_and_streams_in_fragments(client, engine,  # noqa: F811
                                                                     sampling, parallel):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "parallel_tool_calls": parallel,
            "logit_bias": _call_bias(engine), **sampling}
    whole = client.post("/v1/chat/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", whole
    calls = choice["message"]["tool_calls"]
    for call in calls:
        _valid(call)
    events = _sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    pieces = [d for d in deltas if "tool_calls" in d]
    assert len(pieces) >= 3 * len(calls)  # the name first, then the arguments in fragments
    assert pieces[0]["tool_calls"][0]["function"]["arguments"] == ""
    streamed = merged_calls(deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] \
        == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _auto(engine, sampling: dict, bias: bool, grammar: bool = True):  # noqa: F811
    tok = engine.tokenizer
    prompt = engine.encode_chat([ChatMessage("user", "weather in Paris?")], tools=TOOLS)
    lazy = call_grammar(ToolRequest(TOOLS, "auto"), lambda m: token_ref(tok, m))
    params = SamplingParams(**sampling, grammar=lazy if grammar else None,
                            logit_bias=((tok.id_of("<tool_call>"), 100.0),) if bias else ())
    return engine.generate(prompt, sampling=params, max_tokens=60)


def test_free_text_is_what_the_model_writes_without_the_grammar(engine):  # noqa: F811
    constrained, free = _auto(engine, SAMPLINGS[0], False), _auto(engine, SAMPLINGS[0], False,
                                                                     False)
    assert "<tool_call>" not in free.text and constrained.token_ids == free.token_ids
    assert len(free.token_ids) > 5


def test_free_text_is_text(engine):  # noqa: F811
    """What the grammar bans in free text: markers, and bytes that cannot become UTF-8 (the
    random tiny model writes such bytes unconstrained; a trained one hardly ever does)."""
    sampling = {"temperature": 1.0, "seed": 4, "top_k": 5}
    constrained, free = _auto(engine, sampling, False), _auto(engine, sampling, False, False)
    assert "\ufffd" in free.text and "\ufffd" not in constrained.text


@pytest.mark.parametrize("mode", ["lookup", "self"])
def test_speculation_under_the_auto_grammar_is_lossless(engine, mode):  # noqa: F811
    spec = Engine(load_model(engine.loaded.source.path), EngineOptions(
        device="cpu", n_ctx=1024, threads=1, speculate=mode, tree="2,1,1"))
    for sampling in SAMPLINGS:
        for bias in (False, True):
            plain, drafted = _auto(engine, sampling, bias), _auto(spec, sampling, bias)
            assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
            assert "<tool_call>" in plain.text or not bias
    stats = spec.speculation
    assert sum(stats["tree_nodes_per_step"]) > len(stats["tree_nodes_per_step"])  # it drafted
