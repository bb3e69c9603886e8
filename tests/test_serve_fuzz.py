"""Request fuzzing for `ember serve`'s agent fields: tools, tool_choice, tool messages,
response_format and the raw constraint fields (grammar, json_schema, guided_*), logit_bias,
logprobs, penalties and n, with JSON of any shape in each, on the tiny tool-calling model.
Every answer is a 200 or a 4xx in OpenAI's shape, never a 500, and the server keeps
answering."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402

from .test_chat_templates import base_vocab  # noqa: E402,F401
from .test_serve_tools import ASK, TOOLS, WEATHER, engine  # noqa: E402,F401

SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) | \
    st.floats(allow_nan=True, allow_infinity=False) | st.text(max_size=12)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def near(valid):
    """A valid value, or something shaped like it, or anything."""
    return st.just(valid) | ANY


FIELDS = {
    "tools": near(TOOLS) | st.lists(near(WEATHER), max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function",
                                   "function": {"name": "get_time"}}]) | ANY,
    "parallel_tool_calls": st.booleans() | ANY,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
    | st.builds(lambda schema: {"type": "json_schema", "json_schema": {"name": "s",
                                                                        "schema": schema}},
                ANY) | ANY,
    # the raw constraint fields of llama.cpp's and vLLM's servers (constraints.py)
    "grammar": st.sampled_from(['root ::= "a" [0-9]', 'start: "b"', "root ::= (", ""]) | ANY,
    "json_schema": near({"type": "object"}) | ANY,
    "guided_json": near('{"type": "string"}') | near({"enum": [1, 2]}) | ANY,
    "guided_regex": st.sampled_from(["[a-c]+", "(", "\\d{2}", ""]) | st.text(max_size=8) | ANY,
    "guided_choice": st.lists(st.text(max_size=5), max_size=3) | ANY,
    "guided_grammar": st.sampled_from(['start: /[xy]+/', "start: (", 'root ::= "z"']) | ANY,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "-1", "x", "99999999"]),
                                  SCALARS, max_size=3) | ANY,
    "logprobs": st.booleans() | st.integers(-2, 30) | ANY,
    "top_logprobs": st.integers(-2, 30) | ANY,
    "presence_penalty": st.floats(-3, 3) | ANY,
    "frequency_penalty": st.floats(-3, 3) | ANY,
    "n": st.integers(0, 3) | ANY,
    "seed": st.integers(-2**64, 2**65) | ANY,
    "stop": st.lists(st.text(max_size=4), max_size=10) | ANY,
}
MESSAGES = st.lists(st.sampled_from(ASK) | st.fixed_dictionaries({
    "role": st.sampled_from(["assistant", "tool", "user"]) | ANY,
    "content": st.none() | st.text(max_size=20) | ANY,
}, optional={"tool_calls": st.just([{"id": "c", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"city": "x"}'}}]) | ANY, "tool_call_id": ANY}),
    min_size=1, max_size=4) | ANY


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    worker = EngineWorker(engine)
    yield TestClient(create_app(worker, "tiny-tools"), raise_server_exceptions=False)
    worker.close()


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})), messages=MESSAGES,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    stream=st.booleans())
def test_agent_fields_never_crash_the_server(client, fields, messages, path, stream):
    body = {**fields, "max_tokens": 2, "stream": stream}
    body.update({"messages": messages} if path.endswith("chat/completions") else {"prompt": "x"})
    # NaN is sent as Python's json writes it (JSON proper has none; Python's reader takes it)
    r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"server_error"' not in r.text
    else:
        assert r.json()["choices"]


def test_the_server_still_answers(client):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 200
