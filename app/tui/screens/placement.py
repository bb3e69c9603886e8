"""The placement screen: how the engine split each FFN layer between the GPU tier and the host.

It shows the engine stats the App last heard (once loaded, and after each reply); the App
calls `show()` again when newer ones arrive while it is open, so measured figures update.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..widgets.placement_chart import LayerBars, PlanHeader

DENSE = """\
No FFN split: the model runs dense on one device, every FFN neuron computed where the \
rest of the model is.

Start the chat with a GPU-tier budget to split each FFN layer: the hottest neurons go to \
the GPU tier (with attention and the KV cache, if they fit), the cold ones are computed by \
CPU threads. For example:

    ember chat --gpu-budget 4GiB

A profile from `ember profile` (--profile) picks the hot neurons by measured activity and \
lets a predictor skip cold neurons that stay inactive; without one every layer gets the \
same share. This screen then draws the split, layer by layer."""

LOADING = "The model is still loading; its placement appears here once it is ready."
FAILED = "The model did not load, so there is no placement to show."
HINT = "↑ ↓ PgUp PgDn scroll · Esc closes"  # with a chart to scroll


class PlacementScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    PlacementScreen { align: center middle; }
    PlacementScreen > Vertical {
        width: 100%; max-width: 120; height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    PlacementScreen .title { text-style: bold; }
    PlacementScreen PlanHeader { margin-bottom: 1; }
    PlacementScreen #layers { height: 1fr; }
    PlacementScreen #message { height: 1fr; padding-top: 1; }
    PlacementScreen .note { color: $text-muted; }
    """
    BINDINGS = [Binding("escape,f3,q", "dismiss", "Close")]

    def __init__(self, model: str, state: str, stats: dict | None):
        """`state`: the App's model state ("loading", "ready", "failed"); `stats`: the last
        `EnginePort.stats()` (its "hybrid" entry is the placement, None for a dense engine)."""
        super().__init__()
        self._model = model
        self._state, self._stats = state, stats or {}

    def compose(self):
        with Vertical():
            yield Static(f"Placement · {self._model}", classes="title", markup=False)
            yield PlanHeader()
            with VerticalScroll(id="layers"):
                yield LayerBars()
            yield Static(id="message", markup=False)
            yield Static(id="hint", classes="note", markup=False)

    def on_mount(self) -> None:
        self.show(self._state, self._stats)
        self.query_one("#layers").focus()

    def show(self, state: str, stats: dict | None) -> None:
        """Draw `stats` (see __init__); safe to call again with newer ones."""
        self._state, self._stats = state, stats or {}
        report = self._stats.get("hybrid")
        split = state == "ready" and bool(report)
        for widget in (self.query_one(PlanHeader), self.query_one("#layers")):
            widget.display = split
        message = self.query_one("#message", Static)
        message.display = not split
        self.query_one("#hint", Static).update(HINT if split else "Esc closes")
        if split:
            self.query_one(PlanHeader).show(report)
            self.query_one(LayerBars).show(report)
        elif state == "loading":
            message.update(LOADING)
        elif state == "failed":
            message.update(FAILED)
        else:
            message.update(DENSE)
