"""The conversation as a scrolling list of messages rendered as Markdown."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown

# How a reply that did not end naturally is marked under its author line.
FINISH_NOTES = {
    "cancelled": "[cancelled]",
    "length": "[stopped at max tokens]",
    "context": "[context window full]",
}

EMPTY_NOTE = "No messages yet. Type below and press Enter."


class MessageView(Vertical, can_focus=True):
    """One message: an author line and a Markdown body. Focus it and press c to copy it."""

    DEFAULT_CSS = """
    MessageView { height: auto; padding: 0 1; margin-bottom: 1; }
    MessageView:focus { background: $boost; }
    MessageView > .author { text-style: bold; color: $text-muted; }
    MessageView.-assistant > .author { color: $accent; }
    MessageView > Markdown { margin: 0; padding: 0; }
    MessageView > Markdown > *:last-child { margin-bottom: 0; }  /* margin-bottom spaces messages */
    """
    BINDINGS = [Binding("c", "copy", "Copy message")]

    def __init__(self, role: str, content: str = "", finish_reason: str | None = None,
                 streaming: bool = False):
        super().__init__(classes=f"-{role}")
        self.role = role
        self.content = content
        self.finish_reason = finish_reason
        self._streaming = streaming
        self._stream = None

    def compose(self):
        yield Label(self._author_line(), classes="author", markup=False)
        yield Markdown(self.content)

    def _author_line(self) -> str:
        who = "You" if self.role == "user" else "Ember"
        if self._streaming:
            return f"{who} …"
        note = FINISH_NOTES.get(self.finish_reason or "")
        return f"{who} {note}" if note else who

    async def append(self, text: str) -> None:
        """Add streamed text. A MarkdownStream batches appends when tokens outrun rendering."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += text
        await self._stream.write(text)

    async def finish(self, finish_reason: str) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._streaming = False
        self.finish_reason = finish_reason
        self.query_one(".author", Label).update(self._author_line())

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("Message copied to the clipboard")


class MessageList(VerticalScroll):
    DEFAULT_CSS = """
    MessageList { height: 1fr; padding: 1 0 0 0; }
    MessageList > .empty { color: $text-muted; padding: 0 1; }
    """

    async def show(self, messages) -> None:
        """Replace the contents with `messages` (StoredMessage-like: role, content, finish_reason)."""
        await self.remove_children()
        views = [MessageView(m.role, m.content, m.finish_reason) for m in messages]
        await self.mount_all(views or [Label(EMPTY_NOTE, classes="empty")])
        self.scroll_end(animate=False)
        self.anchor()  # follow new content until the user scrolls up

    async def add(self, role: str, content: str = "", streaming: bool = False) -> MessageView:
        await self.query(".empty").remove()
        view = MessageView(role, content, streaming=streaming)
        await self.mount(view)
        self.scroll_end(animate=False)
        self.anchor()
        return view

    def last(self) -> MessageView | None:
        views = self.query(MessageView)
        return views.last() if views else None
