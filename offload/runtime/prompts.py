"""Prompts as token ids: plain text, and conversations written in a chat format (the file's
template, a family's turns or a transcript), carrying that format so a reply ends at its
stop strings."""

from __future__ import annotations

from ember.models.chat_format import (ChatFormat, ChatMessage, render_chat_parts,
                                      resolve_chat_format)
from ember.models.tokenizer import Tokenizer


class ChatPrompt(list):
    """Prompt token ids from `encode_chat`, with the chat format that wrote them, and how
    many of the conversation's oldest messages were left out to fit the context
    (`context_fit.fit_conversation`)."""

    def __init__(self, ids, format: ChatFormat, dropped_messages: int = 0):
        super().__init__(ids)
        self.format = format
        self.dropped_messages = dropped_messages


class PromptEncoder:
    """One model's tokenizer, chat template and end-of-turn tokens, turning text and
    conversations into the ids `Engine.stream()` takes."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, stop_ids: set[int]):
        self.tokenizer, self.chat_template, self.stop_ids = tokenizer, chat_template, stop_ids

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=True, parse_special=parse_special)

    def resolve_chat_format(self, choice: str) -> ChatFormat:
        """What a --chat-format choice means for this model (ConfigError if it cannot be)."""
        return resolve_chat_format(choice, has_template=bool(self.chat_template),
                                   has_token=lambda t: self.tokenizer.id_of(t) is not None,
                                   turn_ends=self._turn_end_texts())

    def encode_chat(self, messages: list[ChatMessage], fmt: ChatFormat,
                    tools: list | None = None) -> ChatPrompt:
        """The conversation (and `tools`, OpenAI's function definitions) written in `fmt`, as
        ids that carry it. The format's markers are special tokens; the messages' contents
        and the tools' JSON are text, whatever they spell."""
        tok = self.tokenizer
        parts = render_chat_parts(messages, fmt, template=self.chat_template,
                                  bos_text=self._token_text(tok.bos_id),
                                  eos_text=self._token_text(tok.eos_id),
                                  bos_added=tok.add_bos and tok.bos_id is not None, tools=tools)
        return ChatPrompt(tok.encode_parts(parts), fmt)

    def _turn_end_texts(self) -> tuple[str, ...]:
        """The spelling of each end-of-turn token (EOS excepted: "</s>" or "<eos>" written
        out is more often text than a turn's end)."""
        ids = [i for i in self.stop_ids if i != self.tokenizer.eos_id]
        return tuple(t for i in ids if (t := self.tokenizer.token_text(i)))

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.token_text(token_id)
