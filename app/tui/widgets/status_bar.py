"""One line under the chat: model state, tokens/s, time to first token, context used / max."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widgets import LoadingIndicator, Static


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; padding: 0 1; }
    StatusBar > LoadingIndicator { width: 6; height: 1; min-height: 1; background: $panel; }
    StatusBar > #status-text { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def compose(self):
        yield LoadingIndicator()
        yield Static(id="status-text", markup=False)

    def loading(self, model: str, note: str = "") -> None:
        self.query_one(LoadingIndicator).display = True
        self._set(f"loading {model}…" + (f" {note}" if note else ""))

    def ready(self, model: str, n_ctx: int) -> None:
        self.query_one(LoadingIndicator).display = False
        self._set(f"{model} · ready · ctx {n_ctx}")

    def failed(self, model: str) -> None:
        self.query_one(LoadingIndicator).display = False
        self._set(f"{model} · failed to load (see the notification)")

    def streaming(self, model: str) -> None:
        self.query_one(LoadingIndicator).display = True
        self._set(f"{model} · replying… (Esc stops)")

    def stats(self, model: str, timings, n_ctx: int) -> None:
        """After a reply: decode speed, time to first token, context used by the conversation."""
        self.query_one(LoadingIndicator).display = False
        used = timings.prompt_tokens + timings.generated_tokens
        self._set(f"{model} · {timings.decode_tokens_per_s:.1f} tok/s · "
                  f"TTFT {timings.ttft_s * 1000:.0f} ms · ctx {used}/{n_ctx}")

    def _set(self, text: str) -> None:
        self.query_one("#status-text", Static).update(text)
