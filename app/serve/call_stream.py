"""A streamed reply that may call tools, cut into OpenAI's deltas as it is generated.

Text streams as content until a call block opens (`<tool_call>`); a reply that opens with JSON
or a code fence is held whole (it may be a bare call: `tools.split_calls`). In Llama 3's and
Mistral's syntaxes (call_syntax.py) calls are held and arrive whole. Each Hermes call block
streams as OpenAI streams calls: a first delta with the call's id and function name once the
model has written the name, then the arguments' JSON text in fragments as it is generated.
Text after the first call is not content (as in `split_calls`); a block that is not a call is
left as text when the reply has no call at all.
"""

from __future__ import annotations

import json
import re

from .call_syntax import PYTHON_TAG, TOOL_CALLS, call_id
from .tools import CLOSE, OPEN, split_calls

# style -> (what a reply held whole opens with, what ends the content in a reply's text)
_OPENERS = {"hermes": (("{", "```"), (OPEN,)),
            "llama3": (("{", "```", PYTHON_TAG), ()),
            "mistral": (("[", "{", "```", TOOL_CALLS), (TOOL_CALLS, '[{"name"'))}
# A call block's JSON up to its arguments' value: {"name": "NAME", "arguments": (as a
# grammar makes the model write it; other spellings are read whole at the block's end)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class CallStream:
    def __init__(self, names: set[str] = frozenset(), style: str = "hermes"):
        """`names`: the offered functions; `style`: the template's call syntax (Hermes
        blocks stream call by call; Llama 3's and Mistral's calls arrive whole at the end)."""
        self._names, self._style = names, style
        self._bare, self._markers = _OPENERS[style]
        self._held = ""  # text not handed out yet
        self._mode = "start"  # then "text", "bare" (held to the end) or "calls"
        self._calls = 0  # calls begun
        self._call_text = ""  # everything from the first call block on (read if none parses)
        self._args_at: int | None = None  # the open call's arguments start in _held
        self._args_sent = 0  # of its arguments' text, what has been streamed

    @property
    def called(self) -> bool:
        return self._calls > 0

    def push(self, delta: str) -> list[tuple]:
        """What `delta` makes certain: ("content", text) and ("call", index, delta) items."""
        self._held += delta
        if self._mode == "calls":
            self._call_text += delta
        if self._mode == "start":
            opening = self._held.lstrip()
            if opening.startswith(self._bare):  # perhaps a bare call: told at the end
                self._mode = "bare"
            elif opening and not any(m.startswith(opening) for m in self._bare):
                self._mode = "text"
        if self._mode == "text":
            return self._text()
        if self._mode == "calls" and self._style == "hermes":
            return self._blocks()
        return []

    def finish(self) -> list[tuple]:
        """The items left when the reply ends."""
        if self._mode in ("start", "text"):
            return [("content", self._held)] if self._held else []
        if self._mode == "bare":
            content, calls = split_calls(self._held, self._names, self._style)
            if not calls:
                return [("content", self._held)]
            return ([("content", content)] if content else []) + self._whole(calls)
        if self._style != "hermes":  # calls held to the end
            content, calls = split_calls(self._call_text, self._names, self._style)
            if calls:
                return ([("content", content)] if content else []) + self._whole(calls)
        if not self.called:  # no block parsed as a call: it was text
            return [("content", self._call_text)] if self._call_text else []
        return []

    def _text(self) -> list[tuple]:
        text = self._held
        at = min((i for i in map(text.find, self._markers) if i >= 0), default=-1)
        if at >= 0:
            self._mode, self._held, self._call_text = "calls", text[at:], text[at:]
            items = [("content", text[:at])] if text[:at] else []
            return items + (self._blocks() if self._style == "hermes" else [])
        longest = max(map(len, self._markers), default=1)
        keep = next((n for n in range(min(longest - 1, len(text)), 0, -1)
                     if any(m.startswith(text[-n:]) for m in self._markers)), 0)
        self._held = text[len(text) - keep:]
        return [("content", text[:len(text) - keep])] if len(text) > keep else []

    def _blocks(self) -> list[tuple]:
        """Stream the call blocks in `_held`, which starts at a block (or between blocks)."""
        items = []
        while True:
            held = self._held
            if self._args_at is None:
                start = held.find(OPEN)
                if start < 0:
                    return items
                head = _HEAD.match(held, start + len(OPEN))
                name = _name(head.group(1)) if head is not None else None
                if name is not None and head.end() < len(held) and held[head.end()] in "{[":
                    items.append(self._begin(name))
                    self._held = held = held[start:]
                    self._args_at, self._args_sent = head.end() - start, 0
                elif CLOSE in held[start:]:  # written another way: read whole
                    end = held.index(CLOSE, start) + len(CLOSE)
                    _, calls = split_calls(held[start:end])
                    items += self._whole(calls)
                    self._held = held[end:]
                    continue
                else:
                    return items
            end = _value_end(held, self._args_at)
            upto = len(held) if end is None else end
            fragment = held[self._args_at + self._args_sent:upto]
            if fragment:
                items.append(("call", self._calls - 1, {"function": {"arguments": fragment}}))
                self._args_sent += len(fragment)
            close = held.find(CLOSE, upto) if end is not None else -1
            if close < 0:
                return items
            self._held, self._args_at = held[close + len(CLOSE):], None

    def _begin(self, name: str) -> tuple:
        self._calls += 1
        return ("call", self._calls - 1, {"id": call_id(self._style),
                                          "type": "function",
                                          "function": {"name": name, "arguments": ""}})

    def _whole(self, calls: list[dict]) -> list[tuple]:
        items = []
        for call in calls:
            self._calls += 1
            items.append(("call", self._calls - 1, call))
        return items


def _name(spelled: str) -> str | None:
    try:
        return json.loads(f'"{spelled}"')
    except ValueError:  # a control character in it: not a name a tool has
        return None


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at `text[start]` ends (just past it); None
    while it is still open. Only brackets outside strings count."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
