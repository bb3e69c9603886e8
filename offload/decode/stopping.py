"""Stop strings in streamed text.

Text that might be the start of a stop string is held back until the next delta shows whether
it is; when a stop string appears, everything from it on is cut and generation ends.
With `strip_leading`, whitespace before the first visible character is dropped (a transcript
prompt ends with "Assistant:", so the reply starts with a space).
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str] | tuple[str, ...] = (), strip_leading: bool = False):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text received but not yet released
        self.stopped = False
        self._at_start = strip_leading  # nothing visible released yet

    def push(self, delta: str) -> str:
        """Feed a text delta; returns the part that is safe to show."""
        if self.stopped:
            return ""
        text = self.pending + delta
        if self._at_start:
            # Only spaces and tabs: a leading newline may begin a stop string such as "\n\n".
            stripped = text.lstrip(" \t")
            if not stripped:
                self.pending = ""
                return ""
            text, self._at_start = stripped, False
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        hold = self._partial_match_length(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """End of generation without a stop string: release what was held back."""
        text, self.pending = self.pending, ""
        return "" if self.stopped else text

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
