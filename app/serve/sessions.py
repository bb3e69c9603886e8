"""Which of the engine's conversations (KV sessions) a prompt should extend.

An OpenAI client names no conversation: each request resends the whole history. The engine
already keeps, per named session, the token ids its KV cache holds and prefills only what a
prompt adds past the longest common prefix (`Engine.stream`). What is left to choose is the
session: the one sharing the longest prefix with the prompt, if that prefix is most of what
the session holds (the prompt continues that conversation, or regenerates its last reply).
Otherwise a new session, so an unrelated prompt that only shares a system prompt does not
truncate another conversation's cache. Beyond `max_sessions` the least recently used one is
released.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class SessionPicker:
    def __init__(self, held_tokens: Callable[[str], list[int]], release: Callable[[str], None],
                 max_sessions: int = 16, prefix: str = "serve"):
        """`held_tokens(name)`: the ids session `name` holds (`Engine.conversation_tokens`);
        `release(name)` frees its cache (`Engine.forget`)."""
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._held, self._release = held_tokens, release
        self.max_sessions, self._prefix = max_sessions, prefix
        self._names: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._count = 0

    def pick(self, prompt_ids: list[int]) -> str:
        """The session to run `prompt_ids` in (marked most recently used)."""
        best, best_shared = None, 0
        for name in self._names:
            held = self._held(name)
            shared = common_prefix(held, prompt_ids)
            # At least half of what it holds: a continuation (the history plus a new turn) or a
            # regenerate; an empty session qualifies too.
            if 2 * shared >= len(held) and (best is None or shared > best_shared):
                best, best_shared = name, shared
        if best is None:
            best = self._new()
        self._names.move_to_end(best)
        return best

    def forget(self, name: str) -> None:
        """Release a session whose cache may be inconsistent (a generation that failed)."""
        if name in self._names:
            del self._names[name]
            self._release(name)

    def _new(self) -> str:
        while len(self._names) >= self.max_sessions:
            oldest, _ = self._names.popitem(last=False)
            self._release(oldest)
        self._count += 1
        name = f"{self._prefix}-{self._count}"
        self._release(name)  # an earlier picker's session of the same name starts empty too
        self._names[name] = None
        return name

    def __len__(self) -> int:
        return len(self._names)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
