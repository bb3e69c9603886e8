"""`ember serve` over real sockets: a client that disconnects cancels its generation (uvicorn in
a thread), the official `openai` client, and `ember serve` started as a process answering
HTTP requests (urllib). The default model under load, and its cancellation times, are in
test_serve_load.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402

MODEL = "tiny-gemma"
# 200 tokens at >= 20 ms each: still generating seconds after the client leaves, unless cancelled.
LONG = {"prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_gemma_gguf):
    from ember.offload.runtime.engine import Engine, EngineOptions

    engine = Engine.load(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=256, threads=1))
    yield engine
    engine.close()


class _PacedEngine:
    """The tiny engine at a pace of `delay` s per event, recording how each generation ended;
    with `gate`, a generation waits at its first event until the gate opens."""

    def __init__(self, engine, delay: float = 0.02, gate: threading.Event | None = None):
        self._engine, self.delay, self.gate = engine, delay, gate
        self.started, self.ended = threading.Event(), []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, *args, **kwargs):
        for event in self._engine.stream(*args, **kwargs):
            self.started.set()
            if self.gate is not None:
                self.gate.wait(30)
            time.sleep(self.delay)
            if hasattr(event, "finish_reason"):
                self.ended.append((event.finish_reason, len(event.token_ids), time.monotonic()))
            yield event


@contextmanager
def _served(engine, **kwargs):
    """(worker, port) of the app served by uvicorn in a thread on a free loopback port."""
    worker = EngineWorker(engine, **kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(worker, MODEL), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _until(lambda: server.started, 30, "the server to start")
        yield worker, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        worker.close()
        sock.close()


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def _post_raw(port: int, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so the test can hang up whenever it likes)."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)
    return conn


def _hang_up(conn: socket.socket) -> float:
    conn.shutdown(socket.SHUT_RDWR)
    conn.close()
    return time.monotonic()


def test_disconnect_cancels_a_streamed_generation(engine):
    paced = _PacedEngine(engine)
    with _served(paced) as (worker, port):
        conn = _post_raw(port, "/v1/completions", {**LONG, "stream": True})
        seen = b""
        while seen.count(b"data: ") < 4:  # tokens are streaming
            seen += conn.recv(4096)
        assert seen.startswith(b"HTTP/1.1 200")
        left = _hang_up(conn)
        _until(lambda: paced.ended, 10, "the generation to end")
        reason, tokens, ended = paced.ended[0]
        assert reason == "cancelled" and tokens < 50, paced.ended
        assert ended - left < 0.2, f"cancelled {ended - left:.3f} s after the disconnect"
        _until(lambda: worker.stats.cancelled == 1, 5, "the worker's count")


def test_disconnect_cancels_a_whole_response_generation(engine):
    paced = _PacedEngine(engine)
    with _served(paced) as (worker, port):
        conn = _post_raw(port, "/v1/completions", LONG)
        _until(paced.started.is_set, 30, "generation to start")
        time.sleep(0.1)
        left = _hang_up(conn)
        _until(lambda: paced.ended, 10, "the generation to end")
        reason, tokens, ended = paced.ended[0]
        assert reason == "cancelled" and tokens < 50, paced.ended
        assert ended - left < 0.2, f"cancelled {ended - left:.3f} s after the disconnect"


def test_a_request_whose_client_left_while_queued_never_runs(engine):
    gate = threading.Event()
    paced = _PacedEngine(engine, delay=0.0, gate=gate)
    with _served(paced, max_queue=2) as (worker, port):
        first = _post_raw(port, "/v1/completions", {**LONG, "max_tokens": 3})
        _until(paced.started.is_set, 30, "the first request to hold the engine")
        second = _post_raw(port, "/v1/completions", {**LONG, "max_tokens": 3})
        _until(lambda: worker.waiting == 1, 10, "the second request to queue")
        _hang_up(second)
        time.sleep(0.2)  # the server sees the hang-up
        gate.set()
        answer = b""
        while not answer.endswith(b"}") and (chunk := first.recv(65536)):
            answer += chunk
        first.close()
        assert answer.startswith(b"HTTP/1.1 200")
        _until(lambda: worker.stats.cancelled == 1, 10, "the queued job to be skipped")
        assert [r for r, _, _ in paced.ended] == ["length"]  # only the first one ran


# -- `ember serve` as a process ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, path: str, body: dict | None = None, key: str | None = "k"):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers=headers), timeout=60)


def test_ember_serve_process_answers_http(tiny_gemma_gguf, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "ember.app.cli", "serve", "--model", str(tiny_gemma_gguf),
           "--host", "0.0.0.0", "--port", str(port), "--device", "cpu", "--threads", "1",
           "--ctx-size", "256", "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     "EMBER_API_KEY": "k"},  # as --api-key k
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"ember serve exited {proc.returncode}: {log_path.read_text()}")
            try:
                return _request(port, "/health", key=None).status == 200
            except OSError:
                return False

        _until(healthy, 180, "ember serve to answer /health")
        chat = json.load(_request(port, "/v1/chat/completions", {
            "model": tiny_gemma_gguf.name, "messages": [{"role": "user", "content": "the cat"}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}))
        assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 5
        with _request(port, "/v1/completions", {"prompt": "the", "max_tokens": 4,
                                                "stream": True}) as stream:
            lines = [line.strip() for line in stream if line.strip()]
        assert lines[-1] == b"data: [DONE]" and len(lines) >= 2
        with pytest.raises(urllib.error.HTTPError) as denied:
            _request(port, "/v1/models", key=None)
        assert denied.value.code == 401
        assert json.load(denied.value)["error"]["code"] == "invalid_api_key"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("ember serve still running 30 s after SIGINT")
    log = log_path.read_text()
    assert proc.returncode in (0, 130), log
    assert "warning" in log and "0.0.0.0" in log  # every interface: said out loud
    assert "Traceback" not in log


def test_the_official_openai_client(engine):
    openai = pytest.importorskip("openai")
    with _served(engine) as (worker, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        messages = [{"role": "user", "content": "the cat sat"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert first.choices[0].finish_reason == "length"
        assert first.usage.completion_tokens == 5
        reply = first.choices[0].message.content
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
        assert chunks[-1].usage.completion_tokens == 5
        # The next turn: the conversation so far comes from the KV cache.
        turn = client.chat.completions.create(
            model=MODEL, max_tokens=3, messages=messages + [
                {"role": "assistant", "content": reply}, {"role": "user", "content": "why"}])
        assert turn.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        timings = turn.model_extra["timings"]  # Ember's field: only the new turn prefilled
        assert timings["cached_tokens"] == turn.usage.prompt_tokens_details.cached_tokens
        assert timings["prefilled_tokens"] == turn.usage.prompt_tokens - timings["cached_tokens"]
        assert 0 < timings["prefilled_tokens"] < first.usage.prompt_tokens
        text = client.completions.create(model=MODEL, prompt="the", max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=messages, n=2)
        assert bad.value.status_code == 400 and bad.value.body["param"] == "n"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="x")


def test_the_openai_client_closing_its_stream_cancels_the_generation(engine):
    openai = pytest.importorskip("openai")
    paced = _PacedEngine(engine)
    with _served(paced) as (worker, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=200,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:  # tokens are streaming
                break
        stream.close()
        left = time.monotonic()
        _until(lambda: paced.ended, 10, "the generation to end")
        reason, tokens, ended = paced.ended[0]
        assert reason == "cancelled" and tokens < 50, paced.ended
        assert ended - left < 0.2, f"cancelled {ended - left:.3f} s after the client closed"
        _until(lambda: worker.stats.cancelled == 1, 5, "the worker's count")
