"""One line under the chat: model state, then after each reply tokens/s, time to first token,
context used / max and the KV cache (blocks on device / host, swaps so far).

After a reply the line is built from ranked parts and the least important are left out until it
fits the bar (again whenever the terminal is resized), so 80 columns keep what matters most.
"""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widgets import LoadingIndicator, Static

SEP = " · "


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; padding: 0 1; }
    StatusBar > LoadingIndicator { width: 6; height: 1; min-height: 1; background: $panel; }
    StatusBar > #status-text { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self):
        super().__init__()
        self._parts: list[tuple[int, str]] = []  # (rank, text) of the stats line, 1 = keep longest

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

    def stats(self, model: str, timings, n_ctx: int, engine_stats: dict | None = None) -> None:
        """After a reply: decode speed, time to first token, context used by the conversation,
        and from `engine_stats` (EnginePort.stats()) the KV cache's blocks and swaps."""
        self.query_one(LoadingIndicator).display = False
        used = timings.prompt_tokens + timings.generated_tokens
        parts = [(7, model), (1, f"{timings.decode_tokens_per_s:.1f} tok/s"),
                 (6, f"TTFT {timings.ttft_s * 1000:.0f} ms"), (2, f"ctx {used}/{n_ctx}")]
        kv = (engine_stats or {}).get("kv")
        if kv:
            parts += kv_parts(kv)
        self._set_parts(parts)

    def on_resize(self) -> None:
        self._fit()

    def _set(self, text: str) -> None:
        self._parts = []
        self.query_one("#status-text", Static).update(text)

    def _set_parts(self, parts: list[tuple[int, str]]) -> None:
        self._parts = parts
        self._fit()

    def _fit(self) -> None:
        if not self._parts:
            return
        # The whole bar's width: the loading indicator is hidden while stats are shown. Zero
        # before the first layout, when nothing is left out (on_resize fits it right after).
        width = self.size.width or 10_000
        self.query_one("#status-text", Static).update(fit_parts(self._parts, width))


def kv_parts(kv: dict) -> list[tuple[int, str]]:
    """The KV cache as ranked parts: "KV 312/1803 dev", "120 host", "3 swaps" (+ dropped)."""
    device_total = kv["device_blocks_used"] + kv["device_blocks_free"]
    swaps = kv.get("swaps_out", 0) + kv.get("swaps_in", 0)
    swapped = f"{swaps} swap" + ("" if swaps == 1 else "s")
    if kv.get("dropped"):
        swapped += f", {kv['dropped']} dropped"
    return [(3, f"KV {kv['device_blocks_used']}/{device_total} dev"),
            (4, f"{kv['host_blocks_used']} host"), (5, swapped)]


def fit_parts(parts: list[tuple[int, str]], width: int) -> str:
    """Join `parts` in order, leaving out the highest-ranked (least important) until it fits.

    The most important part is always kept (the bar's ellipsis cuts it if even that is too long).
    """
    kept = list(parts)
    while len(kept) > 1 and len(SEP.join(t for _, t in kept)) > width:
        kept.remove(max(kept, key=lambda part: part[0]))
    return SEP.join(t for _, t in kept)
