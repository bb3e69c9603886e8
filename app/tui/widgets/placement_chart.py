"""The placement drawn: the GPU tier's plan (budget, what it is charged for) and, per FFN layer,
a bar split into hot neurons (GPU tier), cold neurons computed on the CPU and cold neurons
skipped (the measured part, once the engine has decoded something).

Both widgets render from a hybrid report (`Engine.hybrid_report()`'s dict) with colours from
their component classes, so they follow the app's light or dark theme.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from ember.models.support.sizes import format_size

# Distinct characters as well as colours, so the bars read without colour too. COLD: not
# measured yet, whether computed or skipped.
HOT, COMPUTED, SKIPPED, COLD = "█", "▒", "░", "░"
NO_BUDGET = 1 << 60  # budgets this large mean "none given" (a profile alone, no GPU tier)
CHARGES = (("workspace", "workspace"), ("attention", "attention"), ("kv_pool", "KV pool"),
           ("predictors", "predictors"), ("lm_head", "LM head"), ("ffn_hot", "hot FFN"))

# Component classes shared by both widgets: the bar's three runs and muted labels.
CHART_CSS = """
    & > .chart--hot { color: $accent; }
    & > .chart--computed { color: $primary; }
    & > .chart--cold { color: $foreground 30%; }
    & > .chart--muted { color: $text-muted; }
    & > .chart--strong { text-style: bold; }
"""


class SplitBar:
    """A one-line bar as wide as it is given, made of runs of (fraction, character, style)."""

    def __init__(self, runs: list[tuple[float, str, Style]]):
        self.runs = runs

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, done, edge = options.max_width, 0.0, 0
        for fraction, char, style in self.runs:
            # Cumulative rounding: the runs always add up to the whole width.
            done += fraction
            end = min(width, round(done * width))
            if end > edge:
                yield Segment(char * (end - edge), style)
                edge = end
        if edge < width:
            yield Segment(" " * (width - edge))


def layer_runs(hot: float, computed: float | None) -> list[tuple[float, str, str]]:
    """(fraction, character, component) runs of one layer's bar. `computed` (hot included)
    splits the cold part into computed and skipped neurons; None: not measured yet."""
    hot = min(max(hot, 0.0), 1.0)
    if computed is None:
        return [(hot, HOT, "chart--hot"), (1 - hot, COLD, "chart--cold")]
    computed = min(max(computed, hot), 1.0)
    return [(hot, HOT, "chart--hot"), (computed - hot, COMPUTED, "chart--computed"),
            (1 - computed, SKIPPED, "chart--cold")]


def measured(report: dict) -> bool:
    return any(c is not None for c in report.get("computed_fraction_per_layer") or ())


class ChartWidget(Widget):
    COMPONENT_CLASSES = {"chart--hot", "chart--computed", "chart--cold", "chart--muted",
                         "chart--strong"}

    def __init__(self, report: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.report = report or {}

    def show(self, report: dict) -> None:
        self.report = report
        self.refresh(layout=True)

    def style(self, name: str) -> Style:
        return self.get_component_rich_style(f"chart--{name}")


class LayerBars(ChartWidget):
    """One row per FFN layer: index, the bar, hot fraction, GPU-tier bytes, computed fraction."""

    DEFAULT_CSS = "LayerBars { height: auto; " + CHART_CSS + " }"

    def render(self) -> Table:
        report = self.report
        fractions = report.get("hot_fraction_per_layer") or []
        gpu_bytes = report.get("gpu_ffn_bytes_per_layer") or [None] * len(fractions)
        computed = report.get("computed_fraction_per_layer") or [None] * len(fractions)
        show_computed = measured(report)
        table = Table(box=None, expand=True, padding=(0, 1, 0, 0), show_edge=False,
                      header_style=self.style("muted"))
        table.add_column("layer", justify="right", no_wrap=True)
        table.add_column("hot ▕ cold", ratio=1, no_wrap=True)
        table.add_column("hot", justify="right", no_wrap=True)
        table.add_column("GPU tier", justify="right", no_wrap=True)
        if show_computed:
            table.add_column("computed", justify="right", no_wrap=True)
        for i, (hot, nbytes, done) in enumerate(zip(fractions, gpu_bytes, computed)):
            runs = [(f, ch, self.style(role.removeprefix("chart--")))
                    for f, ch, role in layer_runs(hot, done if show_computed else None)]
            row = [str(i), SplitBar(runs), f"{hot:.0%}",
                   "–" if nbytes is None else format_size(nbytes)]
            if show_computed:
                row.append("–" if done is None else f"{done:.0%}")
            table.add_row(*row)
        return table


class PlanHeader(ChartWidget):
    """The GPU tier: device, budget and planned bytes, the charges, the FFN totals, a legend."""

    DEFAULT_CSS = "PlanHeader { height: auto; " + CHART_CSS + " }"

    def render(self) -> Group:
        r = self.report
        strong = self.style("strong")
        budget = r.get("budget_bytes", 0)
        where = r.get("gpu_tier_device", "?")
        if budget >= NO_BUDGET:
            tier = Text.assemble(("GPU tier ", strong), f"{where} · no budget given "
                                 "(a profile alone: sparse FFN on the host)")
        else:
            tier = Text.assemble(("GPU tier ", strong),
                                 f"{where} · budget {format_size(budget)} "
                                 f"({r.get('split', '?')}) · "
                                 f"{format_size(r.get('gpu_bytes', 0))} planned")
        lines = [tier, self._charges(r.get("charges") or {}, r.get("on_gpu_tier") or {})]
        hot = r.get("hot_fraction")
        if hot is not None:
            lines.append(Text.assemble(
                ("FFN ", strong), f"{hot:.1%} of neurons hot · "
                f"{format_size(r.get('gpu_ffn_bytes', 0))} on the GPU tier, "
                f"{format_size(r.get('host_ffn_bytes', 0))} on the host"))
        if r.get("sparsity") is not None:
            lines.append(Text.assemble(("Measured ", strong), f"{r['sparsity']:.0%} of FFN "
                                       "neurons skipped per decode token"))
        lines.append(self._legend(measured(r)))
        return Group(*lines)

    def _charges(self, charges: dict, on_gpu: dict) -> Table:
        grid = Table.grid(padding=(0, 2, 0, 0), expand=False)
        for _ in range(3):
            grid.add_column(style=self.style("muted"), no_wrap=True)
            grid.add_column(justify="right", no_wrap=True)
        cells = []
        for key, label in CHARGES:
            n = charges.get(key, 0)
            cells += [label, format_size(n) if n else _off_tier(key, on_gpu)]
        for row in range(0, len(cells), 6):
            grid.add_row(*cells[row:row + 6])
        return grid

    def _legend(self, with_computed: bool) -> Text:
        muted = self.style("muted")
        legend = Text.assemble((HOT, self.style("hot")), (" hot (GPU tier)  ", muted))
        if with_computed:
            legend.append_text(Text.assemble(
                (COMPUTED, self.style("computed")), (" cold, computed on CPU  ", muted),
                (SKIPPED, self.style("cold")), (" cold, skipped", muted)))
        else:
            legend.append_text(Text.assemble((COLD, self.style("cold")), (" cold (host)", muted)))
        return legend


def _off_tier(key: str, on_gpu: dict) -> str:
    """What a zero charge means: the part stays on the host, or there is none to place."""
    if key in ("attention", "kv_pool"):
        return "host" if not on_gpu.get("attention_and_kv", True) else "–"
    if key == "lm_head":
        return "host"
    return "–"
