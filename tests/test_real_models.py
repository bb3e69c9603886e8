"""The catalog's real instruct models (Qwen2.5-Coder 0.5B and 1.5B Instruct, Q4_K_M) held to
llama.cpp: token ids, greedy continuations up to llama.cpp's first near-tie, the chat template
end to end, and perplexity within 0.5% of llama.cpp's with flash attention off or on.

Why either: llama.cpp's two attention paths are different kernels with their own fp16
roundings, and on this 492-token text they alone are 0.54% (0.5B) and 0.94% (1.5B) apart;
token by token any two of them (or Ember) differ by 0.08-0.19 nats on the 0.5B, so 492 tokens
cannot resolve finer than ~1%. On 6k tokens of the 1.5B, Ember and llama.cpp agree to 0.03%
(docs/long-context.md).

The references are tests/data/<name>_llamacpp.json, made once by bench/real_model_fixtures.py
from llama.cpp alone. A model not pulled (`ember pull NAME`; `scripts/setup.sh test` pulls the
0.5B) skips its tests; the live comparisons also need the `[baseline]` extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.models.catalog import catalog_model, installed_path
from ember.models.chat_format import ChatMessage
from ember.offload.options.sampling import GREEDY

from .near_ties import agreed_steps

DATA = Path(__file__).parent / "data"
NAMES = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
PPL_TOLERANCE = 0.005

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=NAMES)
def real(request):
    """(name, path, engine, llama.cpp's fixture) of one pulled model."""
    from ember.offload.runtime.engine import Engine, EngineOptions

    name = request.param
    path = installed_path(catalog_model(name))
    if path is None:
        pytest.skip(f"{name} is not pulled (ember pull {name})")
    fixture = json.loads((DATA / f"{name}_llamacpp.json").read_text())
    engine = Engine.load(path, EngineOptions(device="cpu", n_ctx=1024, threads=2))
    yield name, path, engine, fixture
    engine.close()


def test_token_ids_equal_llama_cpps(real):
    _, _, engine, fixture = real
    for case in fixture["tokenize"]:
        assert engine.encode(case["text"]) == case["ids"], case["text"]
        assert engine.encode(case["text"], parse_special=True) == case["ids_special"], case["text"]
    for case in fixture["greedy"]:
        assert engine.encode(case["prompt"]) == case["prompt_ids"]


def _agrees_to_the_first_near_tie(engine, case) -> tuple[int, int]:
    """(steps that must agree, steps that do) of Ember's greedy reply to the case's ids."""
    steps = case["steps"]
    done = engine.generate(case["prompt_ids"], sampling=GREEDY, max_tokens=len(steps),
                           ignore_eos=True)
    reference = [s["id"] for s in steps]
    gaps = [s["top1_logit"] - s["top2_logit"] for s in steps]
    return agreed_steps(reference, gaps, done.token_ids)


def test_greedy_continuations_equal_llama_cpps_to_the_first_near_tie(real):
    """Every prompt, plain and chat: equal ids up to (and past, unless they part there)
    llama.cpp's first step whose top-two logits are within NEAR_TIE."""
    _, _, engine, fixture = real
    report = [(case["prompt"][:40], *_agrees_to_the_first_near_tie(engine, case))
              for case in fixture["greedy"] + fixture["chat"]]
    assert all(same >= must for _, must, same in report), report
    compared = sum(must for _, must, _ in report)
    assert compared >= 4 * len(report), f"too few steps before a near-tie to compare: {report}"


def test_chat_template_end_to_end(real):
    """The file's template as Ember renders it is llama.cpp's prompt, id for id; the reply
    ends at the end of the turn and shows no marker text."""
    _, _, engine, fixture = real
    for case in fixture["chat"]:
        messages = [ChatMessage(m["role"], m["content"]) for m in case["messages"]]
        prompt = engine.encode_chat(messages)
        assert prompt.format.name == "template"
        assert list(prompt) == case["prompt_ids"]
    done = engine.generate(engine.encode_chat([ChatMessage("user", "Say hello in French.")]),
                           sampling=GREEDY, max_tokens=64)
    assert done.finish_reason == "eos" and done.text.strip()
    assert "<|im_" not in done.text and "<|endoftext|>" not in done.text


def _english_ppl(engine, window: int):
    from ember.offload.profile.perplexity import perplexity

    ids = engine.encode((DATA / "english.txt").read_text())
    return ids, perplexity(engine.model, ids, engine.tokenizer.bos_id, window=window)


def _nearest_ratio(ours: float, references: list[float]) -> float:
    """ours / the reference it is nearest to, as a distance from 1."""
    return min(abs(ours / ref - 1) for ref in references)


def test_perplexity_within_half_a_percent_of_llama_cpps(real):
    """Against the figures llama.cpp gave on the same ids and windows (the fixture's), with
    flash attention off and on."""
    _, _, engine, fixture = real
    ref = fixture["perplexity"]
    assert engine.tokenizer.bos_id == ref["bos_id"]
    _, ours = _english_ppl(engine, ref["window"])
    assert ours.tokens == ref["tokens"]
    references = [ref["ppl"], ref["ppl_flash_attn"]]
    assert _nearest_ratio(ours.ppl, references) < PPL_TOLERANCE, (ours.ppl, references)


def test_perplexity_matches_live_llama_cpp(real):
    pytest.importorskip("llama_cpp", reason="the [baseline] extra is not installed")
    from ember.app.baseline import LlamaCpp

    _, path, engine, fixture = real
    window = fixture["perplexity"]["window"]
    ids, ours = _english_ppl(engine, window)
    theirs = [LlamaCpp(path, 2, window, logits_all=True, flash_attn=flash).perplexity(
        ids, engine.tokenizer.bos_id, window) for flash in (False, True)]
    assert all(t.tokens == ours.tokens for t in theirs)
    references = [t.ppl for t in theirs]
    assert _nearest_ratio(ours.ppl, references) < PPL_TOLERANCE, (ours.ppl, references)
