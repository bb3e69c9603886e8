"""The multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it)
inserts a newline."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "shift+enter")


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput {
        height: auto;
        min-height: 3;
        max-height: 8;
    }
    """

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder="Message Ember (Enter sends, Ctrl+J new line)", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea's own key handler, which would insert a newline on Enter.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")

    def set_prompt(self, text: str) -> None:
        """Replace the contents and put the cursor at the end, ready to edit."""
        self.text = text
        self.move_cursor(self.document.end)
