"""The help screen: every key binding, in one table."""

from __future__ import annotations

from rich.table import Table
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("Enter", "send the message"),
    ("Ctrl+J, Shift+Enter", "new line in the message"),
    ("Esc", "stop the reply being written (the partial reply is kept, marked)"),
    ("Ctrl+R", "regenerate the last reply"),
    ("Ctrl+E", "edit and resend your last message"),
    ("Ctrl+O", "copy the last reply (or focus a message and press c)"),
    ("Ctrl+N", "new conversation"),
    ("F2", "rename this conversation"),
    ("Delete", "delete the conversation highlighted in the sidebar"),
    ("Ctrl+F", "search conversation titles"),
    ("Ctrl+B", "show or hide the sidebar"),
    ("Ctrl+S", "settings: system prompt and sampling for this conversation"),
    ("F3", "placement: each FFN layer's hot (GPU tier) and cold (host) neurons"),
    ("F4", "models: switch to another model on this machine (the conversation remembers it)"),
    ("Tab, Shift+Tab", "move between sidebar, messages and input"),
    ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]

FOOTNOTE = ("Conversations are saved as you go in $XDG_DATA_HOME/ember/chat.db. The status bar "
            "shows decode speed, time to first token, context used / max and, when the engine "
            "has them, speculation (tokens per verification), FFN neurons skipped, the share "
            "of FFN neurons hot on the GPU tier and KV-cache blocks on device / host.")


def _key_table() -> Table:
    # A Rich table rather than a Markdown one: it renders in a millisecond, Markdown in a second.
    table = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=True)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(ratio=1)
    for key, what in KEYS:
        table.add_row(key, what)
    return table


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    HelpScreen .title { text-style: bold; margin-bottom: 1; }
    HelpScreen .note { color: $text-muted; margin-top: 1; }
    """
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self):
        with VerticalScroll():
            yield Static("Ember chat: keys (Esc closes)", classes="title")
            yield Static(_key_table())
            yield Static(FOOTNOTE, classes="note", markup=False)
