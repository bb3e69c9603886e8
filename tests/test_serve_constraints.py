"""The raw constraint fields clients send besides response_format: llama.cpp server's `grammar`
and `json_schema`, vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`,
on chat and completions, whole and streamed, on the tiny tool-calling ChatML model: replies
match; two constraints, a malformed one or one llguidance cannot compile are 400s naming it."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from starlette.testclient import TestClient  # noqa: E402

from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402

from .test_chat_templates import base_vocab  # noqa: E402,F401
from .test_serve_tools import engine  # noqa: E402,F401

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["pet"],
          "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"type": "integer",
                                                                "minimum": 0, "maximum": 9}}}
REGEX = r"(yes|no), [a-z]{2,5}\."
CHOICES = ["red", "green", "<|im_end|> blue"]  # a choice spelling a marker is text
GBNF = 'root ::= answer " " digit digit?\nanswer ::= "up" | "down"\ndigit ::= [0-9]\n'
LARK = 'start: ANSWER " " /[0-9]{1,2}/\nANSWER: "up" | "down"\n'


def _matches_schema(text):
    jsonschema.validate(json.loads(text), SCHEMA)


# field -> (value, check of a complete reply)
CASES = {
    "guided_json": (SCHEMA, _matches_schema),
    "guided_json-text": (json.dumps(SCHEMA), _matches_schema),
    "json_schema": (SCHEMA, _matches_schema),
    "guided_regex": (REGEX, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    "guided_choice": (CHOICES, lambda text: text in CHOICES or pytest.fail(text)),
    "grammar": (GBNF, lambda text: re.fullmatch(r"(up|down) [0-9]{1,2}", text)
                or pytest.fail(text)),
    "guided_grammar": (LARK, lambda text: re.fullmatch(r"(up|down) [0-9]{1,2}", text)
                       or pytest.fail(text)),
}


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    worker = EngineWorker(engine)
    yield TestClient(create_app(worker, "tiny-tools"))
    worker.close()


def _post(client, path, field, value, stream, **extra):
    body = {field: value, "max_tokens": 40, "stream": stream, **extra}
    body.update({"messages": [{"role": "user", "content": "pick one"}]}
                if path == "chat" else {"prompt": "pick one:"})
    return client.post(f"/v1/{'chat/completions' if path == 'chat' else 'completions'}",
                       json=body)


def _text(r, path, stream) -> tuple[str, str]:
    """(the reply's text, its finish reason)."""
    if not stream:
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if path == "chat" else choice["text"],
                choice["finish_reason"])
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    pieces = [c["choices"][0]["delta"].get("content") or "" if path == "chat"
              else c["choices"][0]["text"] for c in chunks]
    return "".join(pieces), chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["chat", "completions"])
@pytest.mark.parametrize("case", CASES)
def test_each_constraint_field_shapes_the_reply(client, case, path, stream):
    value, check = CASES[case]
    samplings = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]
    for sampling in samplings[:1] if stream else samplings:
        r = _post(client, path, case.split("-")[0], value, stream, **sampling)
        assert r.status_code == 200, r.text
        text, finish = _text(r, path, stream)
        assert finish == "stop", (text, finish)  # each grammar here ends within max_tokens
        check(text)


def test_the_model_alone_matches_none_of_them(client):
    """The control: unconstrained, the tiny model writes none of these shapes."""
    r = client.post("/v1/completions", json={"prompt": "pick one:", "max_tokens": 12,
                                             "temperature": 0})
    text = r.json()["choices"][0]["text"]
    assert text not in CHOICES and not re.fullmatch(REGEX, text)
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("body, first, second", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "guided_choice"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "response_format", "grammar"),
    ({"json_schema": {}, "guided_json": {}}, "json_schema", "guided_json"),
])
def test_two_constraints_are_a_400_naming_both(client, body, first, second):
    r = client.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert first in error["message"] and second in error["message"]
    assert error["param"] == second


@pytest.mark.parametrize("field, value, says", [
    ("guided_regex", "(unclosed", "cannot be compiled"),
    ("grammar", "root ::= undefined_rule", "cannot be compiled"),
    ("guided_grammar", "start: (", "cannot be compiled"),
    ("guided_choice", [], "guided_choice must be a list"),
    ("guided_choice", ["a", 3], "guided_choice must be a list"),
    ("guided_json", "{not json", "guided_json must be a JSON schema"),
    ("guided_json", {"type": "nonsense"}, "cannot be compiled"),
    ("grammar", 5, "grammar must be a non-empty string"),
])
def test_malformed_or_uncompilable_constraints_are_400s(client, field, value, says):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], field: value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and field in error["message"], error
    assert error["param"] == field, error


def test_a_constraint_with_ignore_eos_or_a_forced_call_is_a_400(client):
    r = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "a+",
                                             "ignore_eos": True})
    assert r.status_code == 400 and "guided_regex" in r.json()["error"]["message"]
