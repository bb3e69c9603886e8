"""The conversation sidebar: a title search box over the list of conversations."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView


class ConversationItem(ListItem):
    def __init__(self, conversation_id: int, title: str):
        super().__init__(Label(title, markup=False))
        self.conversation_id = conversation_id


class ConversationList(ListView):
    BINDINGS = [Binding("delete", "delete_highlighted", "Delete chat")]

    @dataclass
    class DeleteRequested(Message):
        conversation_id: int

    def action_delete_highlighted(self) -> None:
        if isinstance(self.highlighted_child, ConversationItem):
            self.post_message(self.DeleteRequested(self.highlighted_child.conversation_id))


class Sidebar(Vertical):
    DEFAULT_CSS = """
    Sidebar { width: 24; background: $panel; }
    Sidebar > ConversationList { background: $panel; }
    Sidebar > #search { margin-bottom: 1; }
    Sidebar > ConversationList { height: 1fr; }
    Sidebar ConversationItem Label { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def compose(self):
        yield Input(placeholder="Search titles (Ctrl+F)", id="search", compact=True)
        yield ConversationList()

    @property
    def search_text(self) -> str:
        return self.query_one("#search", Input).value

    async def show(self, conversations, current_id: int) -> None:
        """List `conversations` (Conversation-like: id, title), highlighting `current_id`."""
        view = self.query_one(ConversationList)
        await view.clear()
        await view.extend(ConversationItem(c.id, c.title) for c in conversations)
        ids = [c.id for c in conversations]
        if ids:  # the open conversation, or the first match when a search hides it
            view.index = ids.index(current_id) if current_id in ids else 0
