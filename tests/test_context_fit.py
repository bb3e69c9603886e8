"""A conversation that outgrows the context: the oldest exchanges go, the system prompt and
the newest stay, the count is reported; only a newest message too long alone is an error."""

from __future__ import annotations

import pytest

from ember.models.chat_format import ChatFormat, ChatMessage
from ember.models.support.errors import PromptTooLong
from ember.offload.runtime.context_fit import REPLY_ROOM_SHARE, fit_conversation
from ember.offload.runtime.prompts import ChatPrompt


def _encode(messages):
    """One token per word, plus one per message: a stand-in tokenizer that counts exactly."""
    ids = [t for m in messages for t in [0] + [1] * len(m.content.split())]
    return ChatPrompt(ids, ChatFormat("transcript"))


def _chat(turns: int, words: int = 10) -> list[ChatMessage]:
    msgs = [ChatMessage("system", "be brief")]
    for i in range(turns):
        msgs += [ChatMessage("user", " ".join(["q"] * words)),
                 ChatMessage("assistant", " ".join(["a"] * words))]
    return msgs + [ChatMessage("user", "last question here")]


def test_a_conversation_that_fits_is_untouched():
    msgs = _chat(2)
    prompt = fit_conversation(msgs, _encode, n_ctx=200, reply_tokens=50)
    assert list(prompt) == list(_encode(msgs)) and prompt.dropped_messages == 0


def test_the_fewest_oldest_exchanges_go_and_the_system_prompt_stays():
    msgs = _chat(10)  # 3 + 10 * 22 + 4 = 227 tokens
    n_ctx, reply = 128, 16
    prompt = fit_conversation(msgs, _encode, n_ctx, reply)
    dropped = prompt.dropped_messages
    assert dropped % 2 == 0 and dropped > 0  # whole exchanges: user + assistant
    kept = [msgs[0]] + msgs[1 + dropped:]
    assert list(prompt) == list(_encode(kept))
    assert len(prompt) + reply <= n_ctx
    # one exchange fewer dropped would not have fit
    one_less = [msgs[0]] + msgs[1 + dropped - 2:]
    assert len(_encode(one_less)) + reply > n_ctx


def test_the_reply_room_is_capped_at_a_share_of_the_context():
    msgs = _chat(3)  # 3 + 66 + 4 = 73 tokens
    prompt = fit_conversation(msgs, _encode, n_ctx=100, reply_tokens=10_000)
    assert prompt.dropped_messages == 0  # 73 + 25 <= 100
    assert int(100 * REPLY_ROOM_SHARE) == 25


def test_a_newest_message_too_long_alone_is_an_error_naming_it():
    msgs = [ChatMessage("system", "s"), ChatMessage("user", " ".join(["w"] * 300))]
    with pytest.raises(PromptTooLong, match="newest message"):
        fit_conversation(msgs, _encode, n_ctx=128, reply_tokens=16)


def test_the_last_exchange_is_kept_with_less_room_when_that_is_all_that_fits():
    msgs = [ChatMessage("user", "old"), ChatMessage("assistant", "old"),
            ChatMessage("user", " ".join(["w"] * 100))]
    prompt = fit_conversation(msgs, _encode, n_ctx=110, reply_tokens=50)
    assert prompt.dropped_messages == 2 and len(prompt) == 101


def test_an_engine_fits_a_long_chat_and_streams_a_reply(tiny_models):
    from ember.models.loader import load_model
    from ember.offload.options.sampling import GREEDY
    from ember.offload.runtime.engine import Engine, EngineOptions

    engine = Engine(load_model(tiny_models["gemma3"][2]),
                    EngineOptions(device="cpu", n_ctx=128, chat_format="gemma"))
    msgs = [ChatMessage("user", "the cat sat"), ChatMessage("assistant", "on the mat")] * 12
    msgs.append(ChatMessage("user", "and then"))
    prompt = engine.fit_chat(msgs, reply_tokens=8)
    assert prompt.dropped_messages > 0 and len(prompt) + 8 <= engine.n_ctx
    done = engine.generate(prompt, sampling=GREEDY, max_tokens=8)
    assert done.finish_reason in ("length", "eos", "stop")
