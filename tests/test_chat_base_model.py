"""Chat on the default model, a base model without a chat template: the transcript format
makes it answer short questions and stop by itself (issue 19)."""

from __future__ import annotations

import json

import pytest

from ember.models.chat_format import ChatMessage
from ember.offload.sampler import GREEDY

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
