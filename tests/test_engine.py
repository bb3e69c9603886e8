"""Engine.stream(): events, stop conditions, cancellation, prefix reuse, chat formatting."""

from __future__ import annotations

import threading

import pytest
import torch

from ember.models.chat_format import ChatMessage
from ember.models.support.errors import ConfigError
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.decode.events import DoneEvent, TokenEvent
from ember.offload.options.sampling import GREEDY


@pytest.fixture(scope="module")
def engine(tiny_models):
    from ember.models.loader import load_model

    return Engine(load_model(tiny_models["gemma3"][2]), EngineOptions(device="cpu", n_ctx=128))


def _events(engine, ids, **kw):
    return list(engine.stream(ids, sampling=GREEDY, **kw))


def test_stream_yields_tokens_then_one_done(engine):
    ids = engine.encode("the cat")
    events = _events(engine, ids, max_tokens=6, ignore_eos=True)
    assert isinstance(events[-1], DoneEvent)
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_id is not None]
    done = events[-1]
    assert [e.token_id for e in tokens] == done.token_ids and len(tokens) == 6
    assert "".join(e.text for e in events[:-1]) == done.text
    assert done.finish_reason == "length" and done.timings.generated_tokens == 6
    assert done.timings.ttft_s > 0


def test_greedy_is_deterministic_and_prefix_reuse_is_exact(engine):
    ids = engine.encode("the dog is in the")
    engine.runner.reset("default")
    first = engine.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True).token_ids
    # Same prompt again reuses the cache (all but the last prompt token): same output.
    again = engine.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True).token_ids
    engine.runner.reset("default")
    fresh = engine.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True).token_ids
    assert first == again == fresh


def test_eos_ends_generation(engine):
    ids = engine.encode("the")
    free = engine.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
    # The first occurrence of the last distinct token: pretend it is end-of-sequence.
    k = free.index(free[-1])
    engine.stop_ids = {free[k]}
    try:
        done = engine.generate(ids, sampling=GREEDY, max_tokens=12)
    finally:
        engine.stop_ids = set(engine.loaded.source.stop_ids)
    assert done.finish_reason == "eos" and done.token_ids == free[:k]


def test_stop_string_cuts_text(engine):
    ids = engine.encode("the")
    full = engine.generate(ids, sampling=GREEDY, max_tokens=10, ignore_eos=True)
    stop = full.text[3:5]
    if not stop.strip():
        pytest.skip("degenerate random text")
    done = engine.generate(ids, sampling=GREEDY, max_tokens=10, ignore_eos=True, stop=(stop,))
    assert done.finish_reason == "stop"
    assert done.text == full.text[: full.text.find(stop)]


def test_cancel_stops_before_next_token(engine):
    cancel = threading.Event()
    seen = []
    for event in engine.stream(engine.encode("the"), sampling=GREEDY, max_tokens=50,
                               ignore_eos=True, cancel=cancel):
        seen.append(event)
        if len(seen) == 3:
            cancel.set()
    assert seen[-1].finish_reason == "cancelled" and len(seen[-1].token_ids) == 3


@pytest.mark.parametrize("speculate", ["off", "lookup"])
def test_cancel_stops_a_long_prompt_between_chunks(tiny_models, speculate):
    """A client that leaves during a long prefill stops it at the next prompt chunk; the
    session keeps the chunks already done, and a later prompt reuses them."""
    from ember.models.loader import load_model

    engine = Engine(load_model(tiny_models["gemma3"][2]),
                    EngineOptions(device="cpu", n_ctx=128, speculate=speculate))
    engine.runner.prefill_chunk = 8
    model, cancel, passes = engine.runner.model, threading.Event(), []
    pass_rows = model.hidden

    def hidden(ids, cache, *args, **kwargs):  # the client leaves during the second chunk
        passes.append(len(ids))
        if len(passes) == 2:
            cancel.set()
        return pass_rows(ids, cache, *args, **kwargs)

    model.hidden = hidden
    try:
        prompt = list(range(3, 43))  # five chunks of 8
        done = _events(engine, prompt, max_tokens=4, cancel=cancel)[-1]
        assert done.finish_reason == "cancelled" and done.token_ids == []
        assert passes == [8, 8]
        assert engine.runner.sessions["default"].tokens == prompt[:16]
        passes.clear()
        cancel.clear()
        done = _events(engine, prompt, max_tokens=1)[-1]
        assert passes[0] == 8 and sum(passes[:3]) == 24  # the rest only: 16 tokens reused
    finally:
        del model.hidden


def test_a_cancellable_prefill_sizes_its_chunks_to_take_a_short_time(tiny_models):
    """With a cancel event, prompt chunks are sized from the pace of the previous one, so
    cancelling acts within ~CANCEL_CHUNK_S; the prompt's logits are those of plain chunks."""
    import time

    from ember.models.loader import load_model
    from ember.offload.decode import runner as runner_module

    engine = Engine(load_model(tiny_models["gemma3"][2]), EngineOptions(device="cpu", n_ctx=128))
    runner, passes = engine.runner, []
    model = runner.model
    pass_rows = model.hidden

    def hidden(ids, cache, *args, **kwargs):  # at least 5 ms a token
        passes.append(len(ids))
        time.sleep(0.005 * len(ids))
        return pass_rows(ids, cache, *args, **kwargs)

    prompt = list(range(3, 103))
    plain = runner.prefill("plain", prompt)
    model.hidden = hidden
    try:
        timed = runner.prefill("timed", prompt, threading.Event())
    finally:
        del model.hidden
    most = max(runner_module.MIN_CANCEL_CHUNK, int(runner_module.CANCEL_CHUNK_S / 0.005))
    assert passes[0] == runner_module.FIRST_CANCEL_CHUNK and sum(passes) == len(prompt)
    assert all(runner_module.MIN_CANCEL_CHUNK <= n <= most for n in passes[1:-1]), passes
    assert torch.allclose(plain, timed, atol=1e-4, rtol=1e-4)


def test_context_full_finishes_with_context(tiny_models):
    from ember.models.loader import load_model

    small = Engine(load_model(tiny_models["gemma3"][2]), EngineOptions(device="cpu", n_ctx=12))
    ids = small.encode("the cat")
    done = small.generate(ids, sampling=GREEDY, max_tokens=100, ignore_eos=True)
    assert done.finish_reason == "context"
    assert len(ids) + len(done.token_ids) == 12 + 1  # the last token is sampled, not decoded


def test_prompt_filling_the_context_is_an_error(engine):
    with pytest.raises(ConfigError, match="context"):
        _events(engine, [2] * 128, max_tokens=1)


def test_chat_on_a_file_without_template_is_a_transcript(engine):
    assert engine.chat_format.name == "transcript"
    ids = engine.encode_chat([ChatMessage("user", "hi")])
    assert ids.format is engine.chat_format and ids[0] == engine.tokenizer.bos_id
    text = engine.tokenizer.decode(ids)
    assert text.endswith("User: hi\nAssistant:") and text.count("User: ") == 3


def test_gemma_turns_when_asked(engine):
    gemma = Engine(engine.loaded, EngineOptions(device="cpu", n_ctx=128, chat_format="gemma"))
    ids = gemma.encode_chat([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")])
    text = gemma.tokenizer.decode(ids)
    sot, eot = gemma.tokenizer.id_of("<start_of_turn>"), gemma.tokenizer.id_of("<end_of_turn>")
    assert ids[0] == gemma.tokenizer.bos_id and ids.count(sot) == 2 and ids.count(eot) == 1
    assert "Be brief." in text and "hi" in text


def test_unknown_or_impossible_chat_formats_are_config_errors(engine):
    with pytest.raises(ConfigError, match="unknown --chat-format"):
        EngineOptions(chat_format="alpaca")
    with pytest.raises(ConfigError, match="no chat template"):
        Engine(engine.loaded, EngineOptions(device="cpu", n_ctx=128, chat_format="template"))


def test_a_chat_prompt_stops_at_its_format_stop_strings_without_leaking(engine):
    from ember.models.chat_format import ChatFormat
    from ember.offload.runtime.prompts import ChatPrompt

    ids = engine.encode("the")
    free = engine.generate(ids, sampling=GREEDY, max_tokens=16, ignore_eos=True)
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip(), free.text  # a visible stop string in the free-running text
    prompt = ChatPrompt(ids, ChatFormat("test", (stop,), strip_leading_space=True))
    events = _events(engine, prompt, max_tokens=16, ignore_eos=True)
    done = events[-1]
    assert done.finish_reason == "stop" and stop not in done.text
    assert done.text == free.text[:free.text.index(stop)].lstrip(" \t")
    assert "".join(e.text for e in events[:-1]) == done.text


def test_image_markers_and_control_tokens_print_no_text(engine):
    ids = engine.encode("the")
    free = engine.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True)
    hidden = free.token_ids[0]
    engine.hidden_ids = {hidden}
    try:
        done = engine.generate(ids, sampling=GREEDY, max_tokens=8, ignore_eos=True)
    finally:
        engine.hidden_ids = set()
    assert done.token_ids == free.token_ids
    assert done.text == engine.tokenizer.decode(t for t in free.token_ids if t != hidden)
    assert engine.tokenizer.token_bytes(engine.tokenizer.id_of("<end_of_turn>")) == b""


def test_every_family_end_of_turn_token_in_the_vocabulary_stops(engine):
    from types import SimpleNamespace

    from ember.models.loader import ModelSource
    from ember.models.gguf_vocab import VocabSpec
    from ember.models.tokenizer import Tokenizer

    ends = ["<end_of_turn>", "<|eot_id|>", "<|im_end|>"]
    tokens = ["<unk>", "<s>", "</s>", *ends, "<|im_start|>", "a", "b"]
    types = [2, 3, 3, 3, 3, 3, 3, 1, 1]
    tok = Tokenizer.from_vocab(VocabSpec(tokens=tokens, token_types=types, bos_id=1, eos_id=2,
                                         unk_id=0))
    stop_ids = ModelSource.stop_ids.fget(SimpleNamespace(tokenizer=tok, file_stop_ids=()))
    assert {tok.id_of(t) for t in ["</s>", *ends]} <= set(stop_ids)
    assert tok.id_of("a") not in stop_ids
    # The engine's own set comes from its file's vocabulary: EOS and Gemma's end of turn.
    assert {engine.tokenizer.eos_id, engine.tokenizer.id_of("<end_of_turn>")} <= engine.stop_ids


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        _events(engine, [2, engine.loaded.config.vocab_size + 5], max_tokens=1)
