"""The chat App: conversations in a sidebar, the open one in the middle, the prompt below.

Threading: the engine runs in thread workers (`load_model`, `generate`), one at a time (the
Engine is not thread-safe), and reports back only by posting messages (worker_events.py);
all UI and SQLite work happens on the UI thread in the handlers for those messages.
At most one reply is in flight: `self._reply` is it, and every worker message carries the
reply it belongs to, so a stale one is ignored.
Managing conversations (new, rename, delete, search, switch) is the `Conversations` mixin's
(conversations.py).
The engine's own figures (`EnginePort.stats()`: KV cache, FFN split, speculation) come back
with `ModelLoaded` and each `ReplyDone`; the status bar and the placement screen draw them.
Models: F4 picks one from what `ember models` lists; each conversation remembers the model it
last ran on, and opening it switches back to that model (a new port, loaded in turn).
"""

from __future__ import annotations

from typing import Callable

from textual import on, work
from textual.app import App
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from ember.models.chat_format import ChatMessage
from ember.models.support.errors import EmberError
from ember.offload.decode.events import DoneEvent

from .conversations import Conversations, title_from
from .engine_port import EnginePort
from .screens.help import HelpScreen
from .screens.model_picker import ModelPicker
from .screens.placement import PlacementScreen
from .screens.settings_form import SettingsScreen
from .settings import ChatSettings
from .store import DEFAULT_TITLE, ChatStore, Conversation
from .widgets.message_list import MessageList, MessageView
from .widgets.prompt_input import PromptInput
from .widgets.sidebar import Sidebar
from .widgets.status_bar import StatusBar
from .worker_events import (ModelFailed, ModelLoaded, ModelProgress, PendingReply, ReplyDelta,
                            ReplyDone, ReplyFailed)


class ChatApp(Conversations, App):
    TITLE = "Ember"
    CSS = """
    #chat { width: 1fr; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        # Priority: the prompt (a TextArea) would otherwise take Ctrl+E as "end of line".
        Binding("ctrl+e", "edit_last", "Edit", priority=True),
        Binding("ctrl+n", "new_conversation", "New"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("f3", "placement", "Placement"),
        Binding("f4", "pick_model", "Models", show=False),  # the footer is full at 80 columns
        Binding("f1", "help", "Help"),
        Binding("f2", "rename", "Rename", show=False),
        Binding("ctrl+o", "copy_reply", "Copy reply", show=False),
        Binding("ctrl+f", "search", "Search", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", show=False),
    ]

    CHAT_ACTIONS = frozenset(binding.action for binding in BINDINGS)

    def __init__(self, port: EnginePort, store: ChatStore, system_prompt: str = "",
                 greeting: str = "", list_models: Callable[[], list] | None = None):
        """`system_prompt` is given to conversations created in this session; `greeting` is
        shown once the window is up (which model it starts on, and why); `list_models` lists
        what the model picker offers (default: `ember models`' list)."""
        super().__init__()
        self.port = port
        self.store = store
        self.default_system_prompt = system_prompt
        self.greeting = greeting
        self.list_models = list_models
        self.conversation: Conversation | None = None
        self.model_state = "loading"  # loading -> ready | failed
        self.model_error = ""
        self.load_progress = 0.0  # fraction of loading done, as the engine last reported it
        self.engine_stats: dict = {}  # EnginePort.stats() once loaded and after each reply
        self._reply: PendingReply | None = None  # the reply streaming or waiting for the model
        self._reply_view: MessageView | None = None  # where `_reply` streams to, once started

    @property
    def busy(self) -> bool:
        return self._reply is not None

    def compose(self):
        with Horizontal():
            yield Sidebar()
            with Vertical(id="chat"):
                yield MessageList()
                yield PromptInput()
        yield StatusBar()
        yield Footer()

    async def on_mount(self) -> None:
        await self._open(self._initial_conversation())
        self.query_one(StatusBar).loading(self.port.name)
        self.query_one(PromptInput).focus()
        if self.greeting:
            self.notify(self.greeting, timeout=15)
        self.load_model()

    # -- model loading ------------------------------------------------------------------
    def _engine_stats(self) -> dict:
        """Engine figures for the status bar; never a reason to lose a finished reply."""
        try:
            return self.port.stats()
        except Exception:  # the reply is saved either way; the bar just shows less
            return {}

    @work(thread=True, group="engine", exit_on_error=False)
    def load_model(self) -> None:
        def progress(fraction: float, stage: str) -> None:
            self.post_message(ModelProgress(fraction, stage))

        try:
            self.port.load(progress)
        except Exception as exc:  # any failure becomes a notification, never a crash
            self.post_message(ModelFailed(_describe(exc)))
        else:
            self.post_message(ModelLoaded(self._engine_stats()))

    @on(ModelProgress)
    def _model_progress(self, event: ModelProgress) -> None:
        if self.model_state == "loading":
            self.load_progress = event.fraction
            self.query_one(StatusBar).progress(self.port.name, event.fraction, event.stage)

    @on(ModelLoaded)
    async def _model_loaded(self, event: ModelLoaded) -> None:
        self.model_state = "ready"
        self._new_engine_stats(event.stats)
        self.query_one(StatusBar).ready(self.port.name, self.port.n_ctx, self.engine_stats)
        if self._reply is not None:  # a message was sent while loading: answer it now
            await self._start(self._reply)

    @on(ModelFailed)
    async def _model_failed(self, event: ModelFailed) -> None:
        self.model_state, self.model_error = "failed", event.error
        self._new_engine_stats({})
        self.query_one(StatusBar).failed(self.port.name)
        self.notify(event.error, title="Could not load the model", severity="error", timeout=30)
        if self._reply is not None:
            await self._give_up(self._reply)

    # -- sending and streaming ----------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _send(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.busy:
            self.notify("Wait for the reply, or press Esc to stop it.", severity="warning")
            return
        if self.model_state == "failed":
            self.notify(self.model_error, title="The model is not loaded", severity="error")
            return
        self.query_one(PromptInput).clear()
        conversation = self.conversation
        message = self.store.add_message(conversation.id, "user", text)
        # Pending from here on, before anything is awaited, so the footer shows Esc at once.
        self._reply = PendingReply(conversation.id, prompt=text, user_message_id=message.id)
        self.refresh_bindings()
        if self.model_state != "ready":
            self.query_one(StatusBar).loading(self.port.name, "(your message is sent once it is ready)")
        if conversation.title == DEFAULT_TITLE:
            await self._retitle(conversation.id, title_from(text))
        await self.query_one(MessageList).add("user", text)
        if self.model_state == "ready":
            await self._start(self._reply)

    async def _start(self, reply: PendingReply) -> None:
        """Show an empty reply and start the worker that streams into it."""
        history = [ChatMessage(m.role, m.content) for m in self.store.messages(reply.conversation_id)]
        system = self.conversation.system_prompt
        if system:
            history.insert(0, ChatMessage("system", system))
        self.query_one(StatusBar).streaming(self.port.name)
        # Mounted before the worker starts, so the first delta always has somewhere to go.
        self._reply_view = await self.query_one(MessageList).add("assistant", streaming=True)
        self.generate(reply, history, self.conversation.settings)

    @work(thread=True, group="engine", exit_on_error=False)
    def generate(self, reply: PendingReply, history: list[ChatMessage],
                 settings: ChatSettings) -> None:
        try:
            for event in self.port.stream_reply(history, settings, reply.cancel,
                                                session=f"conversation-{reply.conversation_id}"):
                if isinstance(event, DoneEvent):
                    # Asked here, on the engine's thread, before the UI hears the reply is done.
                    self.post_message(ReplyDone(reply, event, self._engine_stats()))
                elif event.text:
                    self.post_message(ReplyDelta(reply, event.text))
        except Exception as exc:
            self.post_message(ReplyFailed(reply, _describe(exc)))

    @on(ReplyDelta)
    async def _reply_delta(self, event: ReplyDelta) -> None:
        if event.reply is self._reply:
            await self._reply_view.append(event.text)

    @on(ReplyDone)
    async def _reply_done(self, event: ReplyDone) -> None:
        if event.reply is not self._reply:
            return
        done, view = event.done, self._reply_view
        if done.finish_reason == "cancelled" and not done.text:
            await view.remove()  # stopped before the first token: nothing worth keeping
            self.notify("Reply stopped before it began.")
        else:
            # Saved the moment it ends, so quitting or a crash right after cannot lose it.
            self.store.add_message(event.reply.conversation_id, "assistant", done.text,
                                   done.finish_reason)
            self._remember_model(event.reply.conversation_id)
            await view.finish(done.finish_reason)
        self._new_engine_stats(event.stats)
        self.query_one(StatusBar).stats(self.port.name, done.timings, self.port.n_ctx, event.stats)
        self._reply, self._reply_view = None, None  # last: not busy once all of the above is done
        self.refresh_bindings()

    @on(ReplyFailed)
    async def _reply_failed(self, event: ReplyFailed) -> None:
        if event.reply is not self._reply:
            return
        await self._reply_view.remove()
        self.notify(event.error, title="The reply failed", severity="error", timeout=15)
        self.query_one(StatusBar).ready(self.port.name, self.port.n_ctx, self.engine_stats)
        await self._give_up(event.reply)

    async def _give_up(self, reply: PendingReply) -> None:
        """Forget `reply`; if it came from the input, take its message back and restore the text."""
        if reply.prompt is not None:
            self.store.delete_messages_from(reply.conversation_id, reply.user_message_id)
            prompt = self.query_one(PromptInput)
            # Keep anything typed since; the failed prompt goes first.
            prompt.set_prompt(reply.prompt + ("\n\n" + prompt.text if prompt.text.strip() else ""))
            prompt.focus()
            last = self.query_one(MessageList).last()
            if last is not None and last.role == "user":
                await last.remove()
        self._reply, self._reply_view = None, None
        self.refresh_bindings()

    def action_stop(self) -> None:
        reply = self._reply
        if reply is None:
            return
        if self.model_state == "ready":
            reply.cancel.set()  # the worker stops before its next token and reports "cancelled"
        else:  # still waiting for the model: keep the message, just don't answer it
            self._reply = None
            self.query_one(StatusBar).loading(self.port.name)
            self.notify("Not sending; press Ctrl+R once the model is ready to get a reply.")
            self.refresh_bindings()

    def check_action(self, action: str, parameters) -> bool | None:
        if len(self.screen_stack) > 1 and action in self.CHAT_ACTIONS:
            return False  # a dialog is open: its keys must not act on the chat behind it
        if action == "stop":
            return self.busy  # Esc appears in the footer only while a reply is pending
        return True

    # -- regenerate, edit, copy ---------------------------------------------------------
    async def action_regenerate(self) -> None:
        if not self._can_start("regenerate"):
            return
        messages = self.store.messages(self.conversation.id)
        if not messages:
            self.notify("Nothing to regenerate yet.")
            return
        if messages[-1].role == "assistant":
            self.store.delete_messages_from(self.conversation.id, messages[-1].id)
            await self.query_one(MessageList).last().remove()
        self._reply = PendingReply(self.conversation.id, prompt=None, user_message_id=None)
        await self._start(self._reply)
        self.refresh_bindings()

    async def action_edit_last(self) -> None:
        if self.busy:
            self.notify("Wait for the reply, or press Esc to stop it.", severity="warning")
            return
        user_turns = [m for m in self.store.messages(self.conversation.id) if m.role == "user"]
        if not user_turns:
            self.notify("No message to edit yet.")
            return
        last = user_turns[-1]
        self.store.delete_messages_from(self.conversation.id, last.id)
        await self.query_one(MessageList).show(self.store.messages(self.conversation.id))
        prompt = self.query_one(PromptInput)
        prompt.set_prompt(last.content)
        prompt.focus()

    def action_copy_reply(self) -> None:
        replies = [m for m in self.store.messages(self.conversation.id) if m.role == "assistant"]
        if not replies:
            self.notify("No reply to copy yet.")
            return
        self.copy_to_clipboard(replies[-1].content)
        self.notify("Last reply copied to the clipboard.")

    def _can_start(self, what: str) -> bool:
        if self.busy:
            self.notify("Wait for the reply, or press Esc to stop it.", severity="warning")
        elif self.model_state != "ready":
            self.notify(f"The model is {self.model_state}; cannot {what} yet.", severity="warning")
        return not self.busy and self.model_state == "ready"

    # -- settings, help, quit -----------------------------------------------------------
    def action_settings(self) -> None:
        conversation = self.conversation

        def saved(result: tuple[str, ChatSettings] | None) -> None:
            if result is None:
                return
            system_prompt, settings = result
            self.store.update_settings(conversation.id, system_prompt, settings)
            if self.conversation.id == conversation.id:
                self.conversation = self.store.conversation(conversation.id)
            self.notify("Settings saved for this conversation.")

        self.push_screen(SettingsScreen(conversation.system_prompt, conversation.settings), saved)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_placement(self) -> None:
        self.push_screen(PlacementScreen(self.port.name, self.model_state, self.engine_stats))

    # -- models -------------------------------------------------------------------------
    def action_pick_model(self) -> None:
        def picked(model: str | None) -> None:
            if model is not None and self.switch_model(model):
                self._remember_model(self.conversation.id)

        self.push_screen(ModelPicker(self.port.model, self.list_models), picked)

    def switch_model(self, model: str) -> bool:
        """Run `model` from now on: a new port with the same options, loaded in a worker.
        Refused (with a notification) while a reply runs or a model is loading."""
        if model == self.port.model:
            return True
        if self.busy or self.model_state == "loading":
            what = "the reply" if self.busy else f"{self.port.name} to load"
            self.notify(f"Wait for {what} before switching models.", severity="warning")
            return False
        old, self.port = self.port, self.port.for_model(model)
        old.close()  # its engine's memory and threads go before the next one loads
        self.model_state, self.model_error, self.load_progress = "loading", "", 0.0
        self._new_engine_stats({})
        self.query_one(StatusBar).loading(self.port.name)
        self.notify(f"Switching to {self.port.name}.")
        self.load_model()
        return True

    def _remember_model(self, conversation_id: int) -> None:
        """The conversation ran (or will run) on the port's model: keep that with it."""
        self.store.set_model(conversation_id, self.port.model)
        if self.conversation.id == conversation_id:
            self.conversation = self.store.conversation(conversation_id)

    def _new_engine_stats(self, stats: dict) -> None:
        """Keep the engine's latest figures and redraw the placement screen if it is open."""
        if stats or self.model_state != "ready":
            self.engine_stats = stats
        for screen in self.screen_stack:
            if isinstance(screen, PlacementScreen):
                screen.show(self.model_state, self.engine_stats)

    async def action_quit(self) -> None:
        # A reply still streaming is saved as cancelled, as if Esc had been pressed.
        reply, view = self._reply, self._reply_view
        if reply is not None:
            reply.cancel.set()
            self._reply, self._reply_view = None, None
            if view is not None and view.content:
                self.store.add_message(reply.conversation_id, "assistant", view.content,
                                       "cancelled")
        self.exit()


def _describe(exc: Exception) -> str:
    """A one-line message for a notification: the text of errors users can act on, else the type."""
    if isinstance(exc, EmberError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
