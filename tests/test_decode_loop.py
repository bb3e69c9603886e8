"""The one decode loop: speculative engines stop for the same reason at the same token as a
plain one (cancel, end of sequence, max tokens, a full context), however many tokens a
speculative step returns; the prompt rule holds in one place, for the engine and the runner."""

from __future__ import annotations

import threading

import pytest
import torch

from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.offload.decode.events import TokenEvent
from ember.offload.options.sampling import GREEDY
from ember.offload.kv.paged import DROPPED
from ember.offload.runtime.engine import Engine, EngineOptions

# Its greedy reply on the tiny SwiGLU llama has no repeated token in the first 24, so each
# stop is a different token; the self-drafter's drafts are accepted in runs.
PROMPT = "wh is the"
MODES = ("off", "lookup", "self")
N = 24


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_model(tiny_models["llama-silu_glu"][2])


def _engine(loaded, mode: str, n_ctx: int = 128) -> Engine:
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=n_ctx, speculate=mode))
    if engine.drafter is not None:
        # Draft the whole tree every step, so steps return several tokens and each stop
        # condition is met inside an accepted run, not only at a step's edge.
        engine.sizer.next_widths = lambda: engine.tree_widths
    return engine


@pytest.fixture(scope="module")
def engines(loaded):
    return {mode: _engine(loaded, mode) for mode in MODES}


def _reply(engine, ids, cancel_after: int | None = None, **kw):
    """(finish reason, token ids); with `cancel_after`, cancelled once that many tokens came."""
    cancel, seen = threading.Event(), 0
    for event in engine.stream(ids, sampling=GREEDY, cancel=cancel, **kw):
        if isinstance(event, TokenEvent) and event.token_id is not None:
            seen += 1
            if seen == cancel_after:
                cancel.set()
    return event.finish_reason, event.token_ids


@pytest.fixture(scope="module")
def plain_tokens(engines):
    ids = engines["off"].encode(PROMPT)
    reason, tokens = _reply(engines["off"], ids, max_tokens=N, ignore_eos=True)
    assert reason == "length" and len(tokens) == N
    return tokens


def test_speculative_steps_return_several_tokens(engines, plain_tokens):
    ids = engines["off"].encode(PROMPT)
    for mode in MODES[1:]:
        assert _reply(engines[mode], ids, max_tokens=N, ignore_eos=True) == ("length", plain_tokens)
    assert max(engines["self"].speculation["accepted_per_step"]) >= 2


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_max_tokens_stops_every_engine_at_the_same_token(engines, plain_tokens, max_tokens):
    ids = engines["off"].encode(PROMPT)
    for mode in MODES:
        got = _reply(engines[mode], ids, max_tokens=max_tokens, ignore_eos=True)
        assert got == ("length", plain_tokens[:max_tokens]), mode


def test_cancel_stops_every_engine_at_the_same_token(engines, plain_tokens):
    ids = engines["off"].encode(PROMPT)
    for k in range(1, 12):
        for mode in MODES:
            got = _reply(engines[mode], ids, cancel_after=k, max_tokens=N, ignore_eos=True)
            assert got == ("cancelled", plain_tokens[:k]), (mode, k)


def test_end_of_sequence_stops_every_engine_at_the_same_token(engines, plain_tokens):
    ids = engines["off"].encode(PROMPT)
    firsts = [k for k, t in enumerate(plain_tokens) if t not in plain_tokens[:k]]
    assert len(firsts) == N  # each token can stand for the end of sequence
    try:
        for k in firsts:
            for engine in engines.values():
                engine.stop_ids = {plain_tokens[k]}
            for mode in MODES:
                assert _reply(engines[mode], ids, max_tokens=N) == ("eos", plain_tokens[:k]), (mode, k)
    finally:
        for engine in engines.values():
            engine.stop_ids = set(engine.loaded.source.stop_ids)


def test_a_full_context_stops_every_engine_at_the_same_token(loaded, plain_tokens):
    ids = _engine(loaded, "off").encode(PROMPT)
    n_ctx = len(ids) + 9
    for mode in MODES:
        reason, tokens = _reply(_engine(loaded, mode, n_ctx), ids, max_tokens=N, ignore_eos=True)
        # The last token is sampled from the full context, not decoded.
        assert (reason, tokens) == ("context", plain_tokens[: n_ctx + 1 - len(ids)]), mode


def test_a_prompt_must_leave_room_for_one_generated_token(loaded):
    engine = _engine(loaded, "off", n_ctx=16)
    reason, tokens = _reply(engine, list(range(3, 18)), max_tokens=N, ignore_eos=True)
    assert reason == "context" and len(tokens) == 2  # 15 + 1 fill the context; +1 sampled
    message = "the prompt has 16 tokens but the context holds 16 for the prompt and its reply"
    with pytest.raises(ConfigError, match=message):
        _reply(engine, list(range(3, 19)), max_tokens=1)
    with pytest.raises(ConfigError, match=message):
        engine.runner.prefill("direct", list(range(3, 19)))
    with pytest.raises(ConfigError, match="the prompt is empty"):
        _reply(engine, [], max_tokens=1)
    with pytest.raises(ConfigError, match="max tokens must be at least 1"):
        _reply(engine, [3, 4], max_tokens=0)


def test_a_session_dropped_at_a_full_context_is_rebuilt_to_decode_its_last_token(loaded):
    """The rebuild replays up to the whole context, which no prompt may fill."""
    n_ctx = 32
    roomy = Engine(loaded, EngineOptions(device="cpu", n_ctx=n_ctx))
    ids = list(range(3, 3 + n_ctx - 1))
    roomy.runner.prefill("a", ids)
    want = roomy.runner.decode("a", 7)
    # The device pool holds one full context and the host pool nothing.
    tight = Engine(loaded, EngineOptions(device="cpu", n_ctx=n_ctx, kv_host_budget=0))
    tight.runner.prefill("a", ids)
    tight.runner.prefill("b", list(range(40, 40 + n_ctx - 1)))  # takes the pool: "a" is dropped
    assert tight.kv.seqs[tight.runner.sessions["a"].seq_id].tier == DROPPED
    torch.testing.assert_close(tight.runner.decode("a", 7), want)
    assert len(tight.runner.tokens("a")) == n_ctx
