"""OpenAI's response objects: whole completions, streamed chunks, usage, the model list.

Beside OpenAI's fields, each completion carries Ember's `timings` (as llama.cpp's server does):
prefill and decode speed, time waiting in the queue, and how many prompt tokens came from a
reused KV cache (also in usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .worker import Finished

# Engine finish reasons -> OpenAI's: an end-of-turn token or a stop string is "stop"; running
# out of max_tokens or of context is "length".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                  "cancelled": "stop"}


@dataclass
class Reply:
    """The identity every object of one response shares."""

    kind: str  # "chat" or "completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def whole(self, result: Finished, logprobs: dict | None = None,
              calls: tuple[str, list[dict]] | None = None) -> dict:
        """The non-streamed response; `logprobs` from `logprobs_json`, when asked for;
        `calls`: (content, tool_calls) read from the reply (tools.split_calls)."""
        done = result.done
        finish = FINISH_REASONS[done.finish_reason]
        if self.kind == "chat":
            body = self._head("chat.completion")
            message = {"role": "assistant", "content": done.text}
            if calls is not None and calls[1]:
                message = {"role": "assistant", "content": calls[0] or None,
                           "tool_calls": calls[1]}
                finish = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": done.text, "logprobs": logprobs,
                      "finish_reason": finish}
        body["choices"] = [choice]
        body["usage"] = usage(result)
        body["timings"] = timings(result)
        return body

    def chunk(self, text: str | None = None, finish: str | None = None,
              first: bool = False, logprobs: dict | None = None) -> dict:
        """One streamed chunk: a text delta, or (with `finish`) the last one, empty;
        `logprobs` those of the tokens since the previous chunk."""
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": text or ""}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
        body["choices"] = [choice]
        return body

    def call_chunk(self, index: int, call: dict) -> dict:
        """A streamed tool call's delta: its first (id, type, function name and arguments
        so far), or a later one (more of the arguments' text)."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": {"tool_calls": [{"index": index, **call}]},
                            "logprobs": None, "finish_reason": None}]
        return body

    def usage_chunk(self, result: Finished) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, usage."""
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(object_name), "choices": [], "usage": usage(result),
                "timings": timings(result)}


def usage(result: Finished) -> dict:
    prompt, completion = len(result.done.prompt_token_ids), len(result.done.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens,
                                      # Ember's: a conversation that outgrew the context
                                      # (offload/runtime/context_fit.py)
                                      "dropped_messages": result.dropped_messages}}


def timings(result: Finished) -> dict:
    t = result.done.timings
    prefilled = t.prompt_tokens - result.cached_tokens
    return {**t.to_dict(), "queued_s": result.queued_s, "cached_tokens": result.cached_tokens,
            "prefilled_tokens": prefilled,
            # over the tokens actually computed, not the reused ones
            "prefill_tokens_per_s": prefilled / t.prefill_s if t.prefill_s > 0 else 0.0}


def logprobs_json(kind: str, entries: list, spell: Callable[[int], tuple[str, bytes]],
                  offset: int = 0) -> dict:
    """OpenAI's logprobs object for (token id, `TokenLogprob`) pairs; `spell(id)` is the
    token's (text, bytes). Chat: {"content": [{token, logprob, bytes, top_logprobs}]};
    completions: parallel lists, text offsets counted from `offset`."""
    if kind == "chat":
        def item(token, logprob):
            text, raw = spell(token)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for t, e in entries], "refusal": None}
    tokens = [spell(t)[0] for t, _ in entries]
    offsets = [offset + sum(map(len, tokens[:n])) for n in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for _, e in entries],
            "top_logprobs": [{spell(i)[0]: lp for i, lp in e.top} for _, e in entries],
            "text_offset": offsets}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "ember"}
