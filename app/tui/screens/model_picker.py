"""The model picker (F4): the models `ember models` lists, one line each, the one running
marked; a model Ember cannot run is shown with the reason and cannot be picked, and a catalog
model not yet downloaded with the `ember pull` that gets it.

Listing reads every file's GGUF header (a fraction of a second each), so it runs in a thread
worker and the list fills in when it is done. Dismisses with the picked model's name (what
--model takes), or None.
"""

from __future__ import annotations

from typing import Callable

from textual import on, work
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ember.models.catalog import CATALOG, installed_path
from ember.models.support.sizes import format_size

from .dialogs import DIALOG_CSS


class ModelPicker(ModalScreen[str | None]):
    DEFAULT_CSS = "ModelPicker {" + DIALOG_CSS + """
        & > Vertical { width: 100; }
        & OptionList { height: auto; max-height: 20; margin-top: 1; }
    }"""
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: str, list_models: Callable[[], list] | None = None):
        """`current`: the running model's name; `list_models`: what to offer (default:
        `ember.models.model_list.list_models`, the stores on this machine)."""
        super().__init__()
        self.current, self._list_models = current, list_models

    def compose(self):
        with Vertical():
            yield Label("Pick a model (Enter), Esc to cancel. Looking for models…",
                        id="picker-title", markup=False)
            yield OptionList()

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()
        self._find()

    @work(thread=True, exit_on_error=False)
    def _find(self) -> None:
        listings = self._listings()
        self.app.call_from_thread(self._show, listings)

    def _listings(self) -> list:
        if self._list_models is not None:
            return self._list_models()
        from ember.models.model_list import list_models

        return list_models()

    def _show(self, listings: list) -> None:
        options = [_option(m, m.name == self.current) for m in listings]
        options += [Option(f"  {m.name}  not downloaded: ember pull {m.name} "
                           f"({format_size(m.size)})", disabled=True)
                    for m in CATALOG if m.packages and installed_path(m) is None]
        picker = self.query_one(OptionList)
        picker.add_options(options)
        runnable = sum(m.runnable for m in listings)
        self.query_one("#picker-title", Label).update(
            f"Pick a model (Enter), Esc to cancel. {runnable} found on this machine.")
        for i, m in enumerate(listings):
            if m.name == self.current:
                picker.highlighted = i

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


def _option(m, current: bool) -> Option:
    mark = "● " if current else "  "
    if not m.runnable:
        return Option(f"{mark}{m.name}  cannot run: {m.problem}", disabled=True)
    params = f"{m.parameters / 1e9:.2f}B" if m.parameters else "?"
    return Option(f"{mark}{m.name}  {m.architecture} · {params} · {format_size(m.size_bytes)} · "
                  f"{m.quant} · {m.chat_format} · {m.store}", id=m.name)
