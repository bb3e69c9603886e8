"""One line under the chat: model state (with loading progress), then after each reply tokens/s,
time to first token, context used / max, speculation acceptance (tokens per verification),
measured FFN sparsity, the hot fraction on the GPU tier, the KV cache (blocks on device /
host, swaps so far) and the chat format ("transcript chat"); the engine figures appear only
when the engine has them.

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
        self._progress = ""  # while loading: "45% · layer 8 of 18"
        self._note = ""  # while loading: why the user is waiting, if a message is queued

    def compose(self):
        yield LoadingIndicator()
        yield Static(id="status-text", markup=False)

    def loading(self, model: str, note: str = "") -> None:
        self.query_one(LoadingIndicator).display = True
        self._note = note
        self._set(" ".join(t for t in (f"loading {model}…", self._progress, note) if t))

    def progress(self, model: str, fraction: float, stage: str) -> None:
        """Loading has reached `fraction` (0..1) at `stage`; shown until the model is ready."""
        self._progress = f"{fraction:.0%}" + (f" · {stage}" if stage else "")
        self.loading(model, self._note)

    def ready(self, model: str, n_ctx: int, engine_stats: dict | None = None) -> None:
        """Loaded: the context size, and how the engine runs (FFN split, speculation)."""
        self.query_one(LoadingIndicator).display = False
        self._progress = ""
        self._set(SEP.join([model, "ready", f"ctx {n_ctx}", *setup_parts(engine_stats or {})]))

    def failed(self, model: str) -> None:
        self.query_one(LoadingIndicator).display = False
        self._set(f"{model} · failed to load (see the notification)")

    def streaming(self, model: str) -> None:
        self.query_one(LoadingIndicator).display = True
        self._set(f"{model} · replying… (Esc stops)")

    def stats(self, model: str, timings, n_ctx: int, engine_stats: dict | None = None) -> None:
        """After a reply: decode speed, time to first token, context used by the conversation,
        and from `engine_stats` (EnginePort.stats()) speculation, the FFN split and the KV
        cache's blocks and swaps."""
        self.query_one(LoadingIndicator).display = False
        engine_stats = engine_stats or {}
        used = timings.prompt_tokens + timings.generated_tokens
        parts = [(10, model), (1, f"{timings.decode_tokens_per_s:.1f} tok/s"),
                 (9, f"TTFT {timings.ttft_s * 1000:.0f} ms"), (2, f"ctx {used}/{n_ctx}")]
        if engine_stats.get("dropped_messages"):  # the conversation outgrew the context
            parts.append((2, f"{engine_stats['dropped_messages']} oldest msgs left out"))
        parts += speculation_parts(engine_stats.get("speculation"))
        parts += hybrid_parts(engine_stats.get("hybrid"))
        kv = engine_stats.get("kv")
        if kv:
            parts += kv_parts(kv)
        if engine_stats.get("chat_format"):
            parts.append((11, f"{engine_stats['chat_format']} chat"))
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
    return [(6, f"KV {kv['device_blocks_used']}/{device_total} dev"),
            (7, f"{kv['host_blocks_used']} host"), (8, swapped)]


def speculation_parts(spec: dict | None) -> list[tuple[int, str]]:
    """Speculation's acceptance as "spec 2.4 tok/step": tokens gained per verification (the
    accepted drafts plus the target's own token); nothing before the first verification."""
    if not spec or not spec.get("verifications"):
        return []
    return [(3, f"spec {spec.get('mean_accepted_length', 0.0):.1f} tok/step")]


def hybrid_parts(report: dict | None) -> list[tuple[int, str]]:
    """The FFN split: measured sparsity ("FFN 62% sparse": neurons not computed per decode
    token, once measured) and the share of FFN neurons on the GPU tier ("GPU 35% hot")."""
    if not report:
        return []
    parts = []
    if report.get("sparsity") is not None:
        parts.append((4, f"FFN {report['sparsity']:.0%} sparse"))
    if report.get("hot_fraction") is not None:
        parts.append((5, f"GPU {report['hot_fraction']:.0%} hot"))
    return parts


def setup_parts(engine_stats: dict) -> list[str]:
    """How the engine runs, for the "ready" line: the chat format, the FFN split and the
    drafter, if any."""
    parts = [f"{engine_stats['chat_format']} chat"] if engine_stats.get("chat_format") else []
    parts += [text for _, text in hybrid_parts(engine_stats.get("hybrid"))]
    speculate = engine_stats.get("speculate")
    if speculate and speculate != "off":
        parts.append(f"speculate {speculate}")
    return parts


def fit_parts(parts: list[tuple[int, str]], width: int) -> str:
    """Join `parts` in order, leaving out the highest-ranked (least important) until it fits.

    The most important part is always kept (the bar's ellipsis cuts it if even that is too long).
    """
    kept = list(parts)
    while len(kept) > 1 and len(SEP.join(t for _, t in kept)) > width:
        kept.remove(max(kept, key=lambda part: part[0]))
    return SEP.join(t for _, t in kept)
