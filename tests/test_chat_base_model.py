"""Chat on the default model, a base model without a chat template: the transcript format
makes it answer short questions and stop by itself (issue 19)."""

from __future__ import annotations

import json

import pytest

from ember.models.chat_format import ChatMessage
from ember.offload.options.sampling import GREEDY

pytestmark = pytest.mark.slow

# (prompt, words one of which an on-topic answer holds), lower case. Varied: facts,
# arithmetic, a list, a translation, a short poem.
PROMPTS = [
    ("What is the largest ocean on Earth?", ["pacific"]),
    ("Name three fruits.", ["apple", "banana", "orange", "grape", "pear", "mango", "cherr"]),
    ("What is the capital of France?", ["paris"]),
    ("How many days are in a week?", ["seven", "7"]),
    ("What colour is the sky on a clear day?", ["blue"]),
    ("Translate 'thank you' into Spanish.", ["gracias"]),
    ("What do bees make?", ["honey"]),
    ("Write a haiku about the sea.", ["sea", "wave", "ocean", "tide", "shore"]),
    ("What is 2 plus 2?", ["four", "4"]),
    ("Who wrote Romeo and Juliet?", ["shakespeare"]),
]
MAX_TOKENS = 40


def _answers(engine) -> list[tuple[str, str, str, bool]]:
    rows = []
    for prompt, words in PROMPTS:
        ids = engine.encode_chat([ChatMessage("user", prompt)])
        done = engine.generate(ids, sampling=GREEDY, max_tokens=MAX_TOKENS)
        on_topic = any(w in done.text.lower() for w in words)
        rows.append((prompt, done.text, done.finish_reason, on_topic))
    return rows


def test_default_model_answers_and_stops_by_itself(default_engine):
    assert default_engine.chat_format.name == "transcript"
    rows = _answers(default_engine)
    good = [r for r in rows if r[2] == "stop" and r[3]]
    report = "\n".join(f"{r[2]:6} {'ok ' if r[3] else 'off'} {r[0]!r} -> {r[1]!r}" for r in rows)
    print(f"\n{len(good)}/{len(rows)} on topic and stopped by themselves\n{report}")
    assert len(good) >= 7, report
    for _, text, _, _ in rows:  # nothing of the format shows in a reply
        assert "User:" not in text and "Assistant:" not in text and not text.startswith(" ")


def test_generate_chat_on_the_default_model(capsys):
    from ember.app.cli import main

    code = main(["generate", "What is the capital of France?", "--chat", "--temperature", "0",
                 "--max-tokens", str(MAX_TOKENS), "--threads", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["chat_format"] == "transcript"
    assert out["finish_reason"] == "stop" and "paris" in out["text"].lower()


def test_control_and_image_tokens_are_special_and_silent(default_engine):
    tok = default_engine.tokenizer
    ids = default_engine.encode("<start_of_turn>user\nhi<end_of_turn>", parse_special=True)
    assert ids[:2] == [tok.bos_id, 105] and ids[-1] == 106
    assert tok.id_of("<start_of_image>") in default_engine.hidden_ids
    assert {1, 106} <= default_engine.stop_ids  # <eos>, <end_of_turn>


def test_chat_app_port_answers_a_follow_up_in_the_same_conversation(default_engine):
    """The chat app's engine port (what `ember chat` runs): two turns of one conversation,
    each ending by itself, the second prefilling only its new turn."""
    import threading

    from .tui_fakes import PreloadedBackend
    from ember.app.tui.settings import ChatSettings

    backend = PreloadedBackend(default_engine, "default")
    assert backend.stats()["chat_format"] == "transcript"
    settings = ChatSettings(temperature=0.0, max_tokens=MAX_TOKENS)
    messages = [ChatMessage("user", "What is the capital of France?")]
    first = list(backend.stream_reply(messages, settings, threading.Event(), session="c1"))[-1]
    assert first.finish_reason == "stop" and "paris" in first.text.lower()
    messages += [ChatMessage("assistant", first.text),
                 ChatMessage("user", "What do bees make?")]
    second = list(backend.stream_reply(messages, settings, threading.Event(), session="c1"))
    done = second[-1]
    assert done.finish_reason == "stop" and "honey" in done.text.lower()
    assert "".join(e.text for e in second[:-1]) == done.text  # the streamed text, no stop string
    # The transcript only grows: the first turn's cache is reused, the new turn prefilled.
    assert default_engine.runner.last_prefill_tokens < len(done.prompt_token_ids) // 4


def test_serve_chat_completion_stops_at_the_transcript_turn(default_engine):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from ember.app.serve.server import create_app
    from ember.app.serve.worker import EngineWorker

    worker = EngineWorker(default_engine, max_queue=2)
    try:
        client = TestClient(create_app(worker, "gemma"))
        body = client.post("/v1/chat/completions", json={
            "model": "gemma", "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "Who wrote Romeo and Juliet?"}]}).json()
    finally:
        worker.close()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", body
    assert "shakespeare" in choice["message"]["content"].lower()
    assert "User:" not in choice["message"]["content"]
