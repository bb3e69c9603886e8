"""When a conversation outgrows the context: the one policy the chat app and the server share.

The oldest turns go first. The leading system (and developer) messages always stay; after
them whole exchanges are dropped from the start (a user message with everything up to the
next user message) until the prompt and room for the reply fit. How many messages were
dropped travels with the prompt (`ChatPrompt.dropped_messages`), so the chat app's status bar
and the server's usage can say so; the conversation goes on, never an error in its middle.

What it costs: the turns kept move to the front of a new prompt, so they are prefilled again
(the cache of the old prompt is not a prefix of the new one). Shifting the cached keys to new
positions instead would keep the cache, but the result is not bit-equal to a fresh run of the
same prompt (RoPE rotations composed in float), so Ember re-prefills.

Only a last exchange that cannot fit even alone, with its system prompt and one token of
reply, is an error (`PromptTooLong`): that is the newest message being too long, which its
sender can act on.
"""

from __future__ import annotations

from typing import Callable

from ember.models.chat_format import ChatMessage
from ember.models.support.errors import PromptTooLong

from .prompts import ChatPrompt

# The room kept for the reply: what the request asks for, at most this share of the context
# (a long reply goes on until the context is full, then stops with finish reason "context").
REPLY_ROOM_SHARE = 0.25
LEADING_ROLES = ("system", "developer")


def fit_conversation(messages: list[ChatMessage], encode: Callable[[list[ChatMessage]], ChatPrompt],
                     n_ctx: int, reply_tokens: int) -> ChatPrompt:
    """`encode(messages)` with the fewest oldest exchanges dropped that leave room for a reply
    of `reply_tokens` (capped at REPLY_ROOM_SHARE of `n_ctx`) in a context of `n_ctx`."""
    room = max(1, min(reply_tokens, int(n_ctx * REPLY_ROOM_SHARE)))
    prompt = encode(messages)
    if len(prompt) + room <= n_ctx:
        return prompt
    lead = next((i for i, m in enumerate(messages) if m.role not in LEADING_ROLES), len(messages))
    # Where each droppable exchange starts after the leading messages: a user message that
    # is not the first; the last exchange is never dropped.
    starts = [i for i in range(lead + 1, len(messages)) if messages[i].role == "user"]

    def trimmed(k: int) -> list[ChatMessage]:  # the first k exchanges dropped
        return messages[:lead] + messages[starts[k - 1]:] if k else messages

    # The token count falls as exchanges go: the fewest that fit, by bisection (each try
    # tokenizes the whole conversation).
    lo, hi = 1, len(starts)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = encode(trimmed(mid))
        if len(candidate) + room <= n_ctx:
            best, hi = (mid, candidate), mid - 1
        else:
            lo = mid + 1
    if best is None:
        # Even the last exchange alone leaves less than the reply's room: keep it if one
        # token of reply fits, else the newest message itself is too long.
        last = encode(trimmed(len(starts)))
        if len(last) + 1 > n_ctx:
            raise PromptTooLong(f"the newest message makes a prompt of {len(last)} tokens, but "
                                f"the context holds {n_ctx} for the prompt and its reply "
                                "together; shorten the message or raise --ctx-size")
        best = (len(starts), last)
    k, prompt = best
    prompt.dropped_messages = len(messages) - len(trimmed(k))
    return prompt
