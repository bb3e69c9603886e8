"""`ember serve`'s routes through Starlette's TestClient, on the tiny Gemma model.

Chat and completions (whole and streamed), usage and KV reuse, the model list and health,
the API key, errors in OpenAI's shape, 429 when the queue is full; the session picker alone.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")  # Starlette's TestClient

from starlette.testclient import TestClient  # noqa: E402

from ember.app.cli import main  # noqa: E402
from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.sessions import SessionPicker  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402

MODEL = "tiny-gemma"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_gemma_gguf):
    from ember.offload.runtime.engine import Engine, EngineOptions

    # Gemma's turns, not the transcript a file without a template gets: the transcript's
    # preamble alone is ~230 tokens of the tiny model's character-level vocabulary.
    engine = Engine.load(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=256, threads=1,
                                                        chat_format="gemma"))
    yield engine
    engine.close()


def _client(engine, **kwargs):
    worker = EngineWorker(engine, max_queue=kwargs.pop("max_queue", 4))
    return TestClient(create_app(worker, MODEL, **kwargs)), worker


@pytest.fixture
def client(engine):
    client, worker = _client(engine)
    yield client
    worker.close()


def _chat(client, messages, **fields):
    return client.post("/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, **fields})


def _sse(response) -> list:
    """The data payloads of a server-sent event stream, JSON-decoded but for [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def _error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_chat_completion_has_openai_shape_and_usage(client):
    r = _chat(client, [{"role": "user", "content": "the cat"}], max_tokens=6, **GREEDY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] > 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6


def test_streamed_chat_matches_the_whole_reply(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a dog"}]
    whole = _chat(client, messages, max_tokens=7, seed=5, temperature=0.9, ignore_eos=True)
    r = _chat(client, messages, max_tokens=7, seed=5, temperature=0.9, ignore_eos=True,
              stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200
    events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk, last = chunks[-1], chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 7
    assert last["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole.json()["choices"][0]["message"]["content"]


def test_completion_whole_and_streamed(client):
    fields = {"model": MODEL, "prompt": "the cat", "max_tokens": 5, **GREEDY}
    whole = client.post("/v1/completions", json=fields).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 5
    events = _sse(client.post("/v1/completions", json={**fields, "stream": True}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-2]  # only with stream_options.include_usage
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]


def test_stop_string_ends_the_reply_and_is_not_returned(client):
    fields = {"model": MODEL, "prompt": "the cat", "max_tokens": 12, **GREEDY}
    text = client.post("/v1/completions", json=fields).json()["choices"][0]["text"]
    stop = text[3:5]  # something the greedy reply is known to contain
    assert stop
    body = client.post("/v1/completions", json={**fields, "stop": [stop]}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[:text.index(stop)]


def test_prompt_as_token_ids(client, engine):
    ids = engine.encode("the cat")
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, **GREEDY})
    by_text = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 4, **GREEDY})
    assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]
    assert by_ids.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_continued_conversation_reuses_its_kv_cache(client):
    first = [{"role": "user", "content": "the cat sat on the mat"}]
    r1 = _chat(client, first, max_tokens=6, **GREEDY).json()
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and the dog"}]
    r2 = _chat(client, turn, max_tokens=6, **GREEDY).json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt at least (its reply may re-tokenize a little differently).
    assert cached >= r1["usage"]["prompt_tokens"], r2["usage"]
    assert r2["timings"]["prefilled_tokens"] == r2["usage"]["prompt_tokens"] - cached
    # An unrelated conversation gets its own session and leaves this one's cache alone.
    other = _chat(client, [{"role": "user", "content": "xyz qrs tuv"}], max_tokens=6, **GREEDY)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
    turn += [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
             {"role": "user", "content": "and the bird"}]
    r3 = _chat(client, turn, max_tokens=4, **GREEDY).json()
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= r2["usage"]["prompt_tokens"]


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    _error(client.get("/v1/models/gpt-4"), 404, code="model_not_found")
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["waiting"] == 0


def test_api_key_is_checked_on_every_route_but_health(engine):
    client, worker = _client(engine, api_key="sesame")
    try:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/nowhere"):
            _error(client.get(path), 401, code="invalid_api_key")
            _error(client.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            _error(client.get(path, headers={"Authorization": "sesame"}), 401)
        _error(client.post("/v1/completions", json={"prompt": "x"}), 401)
        ok = client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200
    finally:
        worker.close()


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "the cat sat " * 200}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the cat " * 300}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "seed": True}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].tool_call_id", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0]", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "tools_not_supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/embeddings", {"input": "x"}, 404, "model", "embeddings_not_supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "strin"}}}}, 400,
     "response_format", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400,
     "response_format", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True,
                              "response_format": {"type": "json_object"}}, 400, "ignore_eos",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": -3}, 400, "presence_penalty", None),
])
def test_bad_requests_are_4xx_in_openai_shape(client, path, body, status, param, code):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    _error(r, status, param, code)


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    r = _chat(client, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0,
              response_format={"type": "text"}, user="me", max_completion_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_routes_and_methods_unknown_are_openai_errors(client):
    _error(client.get("/v1/nothing"), 404, code="not_found")
    _error(client.get("/v1/chat/completions"), 405)


class _GatedEngine:
    """The tiny engine, holding each generation at its first event until `gate` opens."""

    def __init__(self, engine):
        self._engine, self.gate, self.started = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, *args, **kwargs):
        for event in self._engine.stream(*args, **kwargs):
            self.started.set()
            self.gate.wait(30)
            yield event


def test_a_full_queue_answers_429_with_retry_after(engine):
    gated = _GatedEngine(engine)
    client, worker = _client(gated, max_queue=1)
    answers = {}

    def ask(name, path="/v1/completions", body={"prompt": "the cat", "max_tokens": 3, **GREEDY}):
        answers[name] = client.post(path, json=body)

    running = threading.Thread(target=ask, args=("running",))
    waiting = threading.Thread(target=ask, args=("waiting",))
    refused = threading.Thread(target=ask, args=(
        "refused", "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}))
    try:
        running.start()
        assert gated.started.wait(30)  # the first one holds the engine
        waiting.start()
        deadline = time.monotonic() + 30
        while worker.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.waiting == 1
        refused.start()
        refused.join(10)  # answered at once, not queued
        assert "refused" in answers, "a third request was queued past --max-queue 1"
    finally:
        gated.gate.set()
        for thread in (running, waiting, refused):
            if thread.ident is not None:  # started
                thread.join(30)
        worker.close()
    r = answers["refused"]
    _error(r, 429, code="queue_full")
    assert int(r.headers["Retry-After"]) >= 1
    assert answers["running"].status_code == 200 and answers["waiting"].status_code == 200
    assert answers["running"].json()["choices"][0]["text"] == answers["waiting"].json()[
        "choices"][0]["text"]


def test_session_picker_continues_the_conversation_it_extends():
    held = {}
    picker = SessionPicker(lambda n: held.get(n, []), lambda n: held.pop(n, None),
                           max_sessions=2)
    a = picker.pick([1, 2, 3])
    held[a] = [1, 2, 3, 9]  # the prompt and its reply
    assert picker.pick([1, 2, 3, 9, 4, 5]) == a  # the next turn
    assert picker.pick([1, 2, 3, 7]) == a  # a regenerated reply: most of it is shared
    b = picker.pick([1, 8, 8, 8, 8, 8])  # shares only a token: a conversation of its own
    assert b != a
    held[b] = [1, 8, 8, 8, 8, 8]
    assert picker.pick([1, 8, 8, 8, 8, 8, 6]) == b
    c = picker.pick([5, 5])  # a third one: the least recently used (a) is released
    assert c not in (a, b) and a not in held and b in held and len(picker) == 2


def test_serve_help_imports_neither_the_server_nor_torch():
    code = ("import sys\nfrom ember.app.cli import main\n"
            "for argv in (['--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'starlette', 'uvicorn') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--api-key" in res.stdout and res.stdout.strip().endswith("[]"), res.stdout


def test_a_port_in_use_is_one_error_line(capsys, tiny_gemma_gguf):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(tiny_gemma_gguf), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and "ember: error: cannot listen on 127.0.0.1" in err, err


class _FailingEngine(_GatedEngine):
    """The tiny engine, failing after its first event while `failing` is set."""

    def __init__(self, engine):
        super().__init__(engine)
        self.gate.set()
        self.failing = True

    def stream(self, *args, **kwargs):
        for event in super().stream(*args, **kwargs):
            yield event
            if self.failing:
                raise RuntimeError("simulated fault")


def test_an_engine_fault_is_a_500_without_traceback_and_the_server_goes_on(engine):
    failing = _FailingEngine(engine)
    client, worker = _client(failing)
    try:
        body = {"prompt": "the cat", "max_tokens": 4, **GREEDY}
        error = _error(client.post("/v1/completions", json=body), 500)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        assert "simulated fault" not in error["message"]  # details stay in the server log
        events = _sse(client.post("/v1/completions", json={**body, "stream": True}))
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        failing.failing = False
        assert client.post("/v1/completions", json=body).status_code == 200
        assert worker.stats.failed == 2 and worker.stats.finished == 1
    finally:
        worker.close()


def test_hostile_sizes_are_refused_cheaply(client):
    """A 50 MB body (with or without a length), JSON nested 100,000 deep and a 10 MB prompt
    get a 4xx in OpenAI's shape at once, and the server answers the next request."""
    big = b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'
    start = time.perf_counter()
    _error(client.post("/v1/completions", content=big), 413, code="body_too_large")
    chunked = (big[i:i + 2**20] for i in range(0, len(big), 2**20))  # no Content-Length
    _error(client.post("/v1/completions", content=chunked), 413, code="body_too_large")
    for depth in (100_000, 65):
        deep = b'{"prompt": "x", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        _error(client.post("/v1/completions", content=deep), 400, code="invalid_json")
    ten_mb = "the cat " * (10 * 2**20 // 8)
    for path, body in (("/v1/completions", {"prompt": ten_mb}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": ten_mb}]})):
        _error(client.post(path, json=body), 400, code="context_length_exceeded")
    assert time.perf_counter() - start < 10  # tokenizing 10 MB took 17 s before
    _error(client.post("/v1/completions", content=b'{"prompt": "a\\ud800b"}'), 400, "prompt")
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_logprobs_penalties_and_bias_whole_and_streamed(client, engine):
    fields = dict(logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=0.5,
                  logit_bias={"5": 3}, max_tokens=6, **GREEDY)
    whole = _chat(client, [{"role": "user", "content": "the cat"}], **fields).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 6
    for item in content:
        assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"] or not item["bytes"]
    streamed = _sse(_chat(client, [{"role": "user", "content": "the cat"}], stream=True,
                          **fields))
    parts = [c["choices"][0]["logprobs"] for c in streamed[:-1] if c["choices"][0]["logprobs"]]
    assert [i for p in parts for i in p["content"]] == content
    r = client.post("/v1/completions", json={"prompt": "the cat", "logprobs": 1, "max_tokens": 4,
                                             **GREEDY}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["text_offset"][0] == 0


def test_n_above_one_is_a_clear_400(client):
    error = _error(_chat(client, [{"role": "user", "content": "x"}], n=3), 400, "n",
                   "unsupported_parameter")
    assert "one choice per request" in error["message"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
          "properties": {"word": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_object(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    formats = [({"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
                SCHEMA), ({"type": "json_object"}, {"type": "object"})]
    for fmt, schema in formats:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            r = _chat(client, [{"role": "user", "content": "the cat"}], response_format=fmt,
                      stream=stream, max_tokens=60, **sampling)
            assert r.status_code == 200, r.text
            if stream:
                chunks = _sse(r)[:-1]
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                text = r.json()["choices"][0]["message"]["content"]
                finish = r.json()["choices"][0]["finish_reason"]
            if finish == "stop":  # complete: it validates (a length cut may not be whole)
                jsonschema.validate(json.loads(text), schema)
            assert text.startswith("{")
