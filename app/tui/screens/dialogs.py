"""Small modal dialogs: ask for a line of text, confirm a destructive action."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

DIALOG_CSS = """
    align: center middle;
    & > Vertical {
        width: 60; max-width: 100%; height: auto;
        border: round $accent; background: $surface; padding: 1 2;
    }
    & Horizontal { height: auto; margin-top: 1; align-horizontal: right; }
    & Button { margin-left: 2; }
"""


class TextPrompt(ModalScreen[str | None]):
    """Ask for one line of text; dismisses with the stripped text, or None if cancelled/empty."""

    DEFAULT_CSS = "TextPrompt {" + DIALOG_CSS + "}"
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self._question, self._value = question, value

    def compose(self):
        with Vertical():
            yield Label(self._question, markup=False)
            yield Input(self._value, select_on_focus=True)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class Confirm(ModalScreen[bool]):
    DEFAULT_CSS = "Confirm {" + DIALOG_CSS + "}"
    BINDINGS = [Binding("escape,n", "dismiss(False)", "No"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str, yes: str = "Yes"):
        super().__init__()
        self._question, self._yes = question, yes

    def compose(self):
        with Vertical():
            yield Label(self._question, markup=False)
            with Horizontal():
                yield Button(self._yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
