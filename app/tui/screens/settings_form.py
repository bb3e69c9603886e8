"""The settings screen: system prompt, sampling and chat format for the current conversation.

Invalid values keep the screen open with the reason shown under the fields and the offending
field focused; nothing is saved until every field is valid.
"""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from ..settings import ChatSettings, SettingError

# Field name -> label; the order is the order on screen.
FIELDS = {
    "temperature": "Temperature (0 = greedy)",
    "top_p": "Top-p (1 = off)",
    "top_k": "Top-k (0 = off)",
    "min_p": "Min-p (0 = off)",
    "repeat_penalty": "Repeat penalty (1 = off)",
    "max_tokens": "Max tokens per reply",
    "seed": "Seed (blank = random)",
    "chat_format": "Chat format",
}

# What a blank field means, where that is not in the label.
PLACEHOLDERS = {"chat_format": "as started (--chat-format)"}


class SettingsScreen(ModalScreen[tuple[str, ChatSettings] | None]):
    """Dismisses with (system prompt, settings) on save, None on cancel."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Vertical {
        width: 72; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    SettingsScreen .title { text-style: bold; margin-bottom: 1; }
    SettingsScreen Grid { grid-size: 2; grid-columns: 28 1fr; grid-rows: 1; grid-gutter: 0 1; height: auto; }
    SettingsScreen Input { background: $boost; }  /* compact inputs need a visible field */
    SettingsScreen Input.-invalid { background: $error 30%; }
    SettingsScreen #error { color: $text-error; margin-top: 1; height: auto; }
    SettingsScreen Horizontal { height: auto; align-horizontal: right; }
    SettingsScreen Button { margin-left: 2; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system_prompt: str, settings: ChatSettings):
        super().__init__()
        self._system_prompt, self._settings = system_prompt, settings

    def compose(self):
        form = self._settings.as_form()
        with Vertical():
            yield Label("Settings for this conversation", classes="title")
            with Grid():
                yield Label("System prompt")
                yield Input(self._system_prompt, id="system_prompt", compact=True,
                            placeholder="(none)")
                for name, label in FIELDS.items():
                    yield Label(label)
                    yield Input(form[name], id=name, compact=True,
                                placeholder=PLACEHOLDERS.get(name, ""))
            yield Label("", id="error", markup=False)
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def action_save(self) -> None:
        for field in self.query(Input):
            field.remove_class("-invalid")
        try:
            settings = ChatSettings.from_form({name: self.query_one(f"#{name}", Input).value
                                               for name in FIELDS})
        except SettingError as exc:
            self.query_one("#error", Label).update(str(exc))
            if exc.field in FIELDS:
                field = self.query_one(f"#{exc.field}", Input)
                field.add_class("-invalid")
                field.focus()
            return
        self.dismiss((self.query_one("#system_prompt", Input).value.strip(), settings))

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
