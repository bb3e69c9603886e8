"""Conversations keep their KV cache: sessions swap out and back in, or are recomputed when
dropped, and the tokens are the same as with no paging at all."""

from __future__ import annotations

import pytest
import torch

from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.kv.plan import blocks_for_one_sequence
from ember.offload.body.file_blocks_model import kv_dtype
from ember.offload.options.sampling import GREEDY

N_CTX = 96


def _engine(path, device_blocks=None, host_blocks=None):
    loaded = load_model(path)
    value_bytes = kv_dtype(EngineOptions(device="cpu"), torch.device("cpu")).itemsize
    bb = 2 * 16 * loaded.config.n_kv_heads * loaded.config.head_dim * value_bytes
    opts = EngineOptions(device="cpu", n_ctx=N_CTX,
                         kv_budget=None if device_blocks is None else device_blocks * bb,
                         kv_host_budget=None if host_blocks is None else host_blocks * bb)
    return Engine(loaded, opts)


def _turns(engine, conversations, rounds=3):
    """Alternate between conversations; each turn extends that conversation's prompt."""
    history = {name: engine.encode(text) for name, text in conversations.items()}
    outputs = {name: [] for name in conversations}
    for r in range(rounds):
        for name in conversations:
            done = engine.generate(history[name], sampling=GREEDY, max_tokens=6,
                                   ignore_eos=True, session=name)
            outputs[name].append(done.token_ids)
            history[name] = history[name] + done.token_ids + engine.encode(" and")[1:]
    return outputs


# Long enough that the three together overflow a device pool sized for one full context.
CONVERSATIONS = {"a": "the cat is in the hat " * 4, "b": "where is the dog and the cat " * 3,
                 "c": "on the log in the fog " * 4}


@pytest.fixture(scope="module")
def expected(tiny_gemma_gguf):
    """Each conversation alone in a roomy engine: the reference tokens."""
    out = {}
    for name, text in CONVERSATIONS.items():
        out.update(_turns(_engine(tiny_gemma_gguf), {name: text}))
    return out


def test_sessions_swap_out_and_in_losslessly(tiny_gemma_gguf, expected):
    cfg = load_model(tiny_gemma_gguf).config
    one = blocks_for_one_sequence(cfg, N_CTX, 16)
    engine = _engine(tiny_gemma_gguf, device_blocks=one, host_blocks=3 * one)
    assert _turns(engine, CONVERSATIONS) == expected
    usage = engine.kv_usage()
    assert usage["swaps_out"] > 0 and usage["swaps_in"] > 0 and usage["dropped"] == 0
    assert usage["device_blocks_used"] <= one


def test_dropped_sessions_are_recomputed_not_corrupted(tiny_gemma_gguf, expected):
    cfg = load_model(tiny_gemma_gguf).config
    one = blocks_for_one_sequence(cfg, N_CTX, 16)
    engine = _engine(tiny_gemma_gguf, device_blocks=one, host_blocks=0)
    assert _turns(engine, CONVERSATIONS) == expected
    assert engine.kv_usage()["dropped"] > 0


def test_new_turn_prefills_only_new_tokens(tiny_gemma_gguf):
    engine = _engine(tiny_gemma_gguf)
    first = engine.encode("the cat is in the hat")
    engine.generate(first, sampling=GREEDY, max_tokens=4, session="x")
    held = len(engine.runner.tokens("x"))
    follow = engine.runner.tokens("x") + engine.encode(" and the dog")[1:]
    done = engine.generate(follow, sampling=GREEDY, max_tokens=1, session="x")
    # Only the tokens past what the session held went through prefill.
    assert done.timings.prompt_tokens == len(follow)
    assert engine.runner.last_prefill_tokens == len(follow) - held
