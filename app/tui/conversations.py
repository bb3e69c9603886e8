"""The App's conversation management: open, new, rename, delete, search and switch.

`Conversations` is a mixin for `ChatApp` (app.py), which provides what it uses: `store` (a
ChatStore), `conversation` (the one open), `default_system_prompt`, `busy` (a reply is pending),
`port` and `switch_model` (a conversation opened returns to the model it last ran on) and the
App's own `query_one`, `notify` and `push_screen`. Its message handlers use Textual's
naming convention (`on_<widget>_<message>`), which, unlike `@on`, also works in a mixin.
"""

from __future__ import annotations

from textual.widgets import Input, ListView

from .screens.dialogs import Confirm, TextPrompt
from .store import ChatStore, Conversation
from .widgets.message_list import MessageList
from .widgets.prompt_input import PromptInput
from .widgets.sidebar import ConversationItem, ConversationList, Sidebar

TITLE_CHARS = 40  # a new conversation is titled after the start of its first message
CURRENT_KEY = "current_conversation"


class Conversations:
    def _initial_conversation(self) -> Conversation:
        return initial_conversation(self.store, self.default_system_prompt, self.port.model)

    async def _open(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.store.set_state(CURRENT_KEY, str(conversation.id))
        await self.query_one(MessageList).show(self.store.messages(conversation.id))
        await self._refresh_sidebar()

    async def _refresh_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        await sidebar.show(self.store.list_conversations(sidebar.search_text), self.conversation.id)

    async def _retitle(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        if self.conversation.id == conversation_id:
            self.conversation = self.store.conversation(conversation_id)
        await self._refresh_sidebar()

    async def on_list_view_selected(self, event: ListView.Selected) -> None:
        """A conversation picked in the sidebar (ConversationList is the app's only ListView)."""
        item = event.item
        if not isinstance(event.list_view, ConversationList) or not isinstance(item, ConversationItem):
            return
        if item.conversation_id == self.conversation.id:
            return
        if self.busy:
            self.notify("Wait for the reply, or press Esc to stop it, before switching.",
                        severity="warning")
            await self._refresh_sidebar()
            return
        conversation = self.store.conversation(item.conversation_id)
        await self._open(conversation)
        if conversation.model and conversation.model != self.port.model:
            self.switch_model(conversation.model)
        self.query_one(PromptInput).focus()

    async def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search" and isinstance(event.input.parent, Sidebar):
            await self._refresh_sidebar()

    async def action_new_conversation(self) -> None:
        if self.busy:
            self.notify("Wait for the reply, or press Esc to stop it.", severity="warning")
            return
        await self._open(self.store.create_conversation(self.default_system_prompt,
                                                        model=self.port.model))
        self.query_one(PromptInput).focus()

    def action_rename(self) -> None:
        async def renamed(title: str | None) -> None:
            if title:
                await self._retitle(self.conversation.id, title)

        self.push_screen(TextPrompt("Rename this conversation:", self.conversation.title), renamed)

    def on_conversation_list_delete_requested(self, event: ConversationList.DeleteRequested) -> None:
        target = self.store.conversation(event.conversation_id)
        if target is None:
            return
        if self.busy and target.id == self.conversation.id:
            self.notify("Stop the reply (Esc) before deleting this conversation.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            self.store.delete_conversation(target.id)
            if target.id == self.conversation.id:
                await self._open(self._initial_conversation())
            else:
                await self._refresh_sidebar()
            self.notify(f"Deleted “{target.title}”.")

        self.push_screen(Confirm(f"Delete “{target.title}” and all its messages?", "Delete"),
                         confirmed)

    def action_search(self) -> None:
        self.query_one(Sidebar).display = True
        self.query_one("#search").focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        sidebar.display = not sidebar.display


def initial_conversation(store: ChatStore, system_prompt: str = "",
                         model: str = "") -> Conversation:
    """The conversation open when the app last closed, else the latest, else a new one (with
    `system_prompt`, on `model`)."""
    saved = store.get_state(CURRENT_KEY)
    if saved is not None and saved.isdigit():
        conversation = store.conversation(int(saved))
        if conversation is not None:
            return conversation
    existing = store.list_conversations()
    if existing:
        return existing[0]
    return store.create_conversation(system_prompt, model=model)


def title_from(text: str) -> str:
    """A conversation's title from its first message: the first line, cut to TITLE_CHARS."""
    first_line = text.strip().splitlines()[0]
    return first_line if len(first_line) <= TITLE_CHARS else first_line[:TITLE_CHARS - 1] + "…"
