"""Turn a conversation into prompt text, in one of several chat formats.

- "template": the model file's own `tokenizer.chat_template` (Jinja), rendered in a sandbox
  because templates come from downloaded files.
- "transcript": for base models (a file without a template, such as the default Gemma 3
  270M): a plain-text conversation a base model continues sensibly, opened by a short
  preamble with two example exchanges (part of the format, never shown as conversation).
  The reply ends where the model starts the next user line.
- a family's instruction format ("gemma", "llama3", "chatml", "inst"), only when asked.

"auto" picks the template when the file has one, else the transcript. BOS is added by the
tokenizer, so a template's leading BOS text is removed here.

Message contents are text, never markers: `render_chat_parts` says which stretches of the
prompt the format wrote and which are contents, so the tokenizer recognizes special tokens
only in the former (a relayed document spelling "<|im_end|>" must not forge a turn). It renders
each content as a unique sentinel and puts the content back in its place, trimmed on the sides
where the template trimmed the sentinel's whitespace padding.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Callable

from .support.errors import ConfigError, ModelFormatError

FAMILY_FORMATS = ("gemma", "llama3", "chatml", "inst")
CHAT_FORMATS = ("auto", "template", "transcript", *FAMILY_FORMATS)

# The marker token each family format needs in the vocabulary ("inst" is plain text).
_FORMAT_TOKENS = {"gemma": "<start_of_turn>", "llama3": "<|start_header_id|>",
                  "chatml": "<|im_start|>"}

# Tokens that mark non-text content (images) in vocabularies that file them as ordinary
# user-defined tokens: a reply never shows them as text.
NON_TEXT_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "[multimodal]")

_PREAMBLE = ("A chat between a curious user and a helpful assistant. The assistant replies "
             "briefly, accurately and to the point.")
_EXAMPLES = (("What is the capital of Japan?", "The capital of Japan is Tokyo."),
             ("Give me two colours of the rainbow.", "Red and blue."))
_USER, _ASSISTANT = "User:", "Assistant:"


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant" or "tool" (a tool's result)
    content: str
    # An assistant's calls, as templates read them: {"type": "function", "id": ...,
    # "function": {"name": ..., "arguments": {...}}}
    tool_calls: tuple = ()
    tool_call_id: str | None = None  # a tool message: the call it answers


@dataclass(frozen=True)
class ChatFormat:
    """A resolved chat format: its name and the strings that end the assistant's reply
    (the stop strings never appear in the reply; end-of-turn tokens stop it too)."""

    name: str
    stop_strings: tuple[str, ...] = ()
    # The prompt ends with "Assistant:", so the reply opens with a space nobody should see.
    strip_leading_space: bool = False


def resolve_chat_format(choice: str, *, has_template: bool,
                        has_token: Callable[[str], bool] = lambda t: False,
                        turn_ends: tuple[str, ...] = ()) -> ChatFormat:
    """The format `choice` ("auto", "template", "transcript" or a family) means for a model.

    `turn_ends`: the text of the vocabulary's end-of-turn tokens. Generation stops at those
    tokens; as stop strings they also end a reply that spells one out in ordinary pieces,
    which would otherwise show the marker as text.

    Raises ConfigError for an unknown choice, "template" on a file without one, or a family
    format whose turn tokens the vocabulary lacks.
    """
    if choice not in CHAT_FORMATS:
        raise ConfigError(f"unknown --chat-format {choice!r}; choose one of "
                          f"{', '.join(CHAT_FORMATS)}")
    if choice == "auto":
        choice = "template" if has_template else "transcript"
    if choice == "template" and not has_template:
        raise ConfigError("--chat-format template: this model file has no chat template (a base "
                          "model); use transcript or a family format such as gemma")
    token = _FORMAT_TOKENS.get(choice)
    if token is not None and not has_token(token):
        raise ConfigError(f"--chat-format {choice} needs the {token} token, which this model's "
                          "vocabulary lacks")
    if choice == "transcript":
        return ChatFormat("transcript", (f"\n{_USER}", f"\n{_ASSISTANT}", "\n\n"),
                          strip_leading_space=True)
    return ChatFormat(choice, tuple(turn_ends))


def template_style(template: str) -> str | None:
    """The family format a chat template writes, told by its turn markers ("chatml", ...),
    or None for another style: what `ember models` shows beside "template"."""
    markers = {**_FORMAT_TOKENS, "inst": "[INST]"}
    return next((name for name, marker in markers.items() if marker in template), None)


# A content's stand-in while the format renders: private-use characters no tokenizer merges
# across, padded with whitespace so a template's trim shows as the padding gone.
_PAD = " \n"
# A stand-in, or JSON the template wrote with tojson (tools, call arguments: text too).
_SENTINEL = re.compile(r"(?P<left>(?: \n)?)\ue000(?P<n>\d+)\ue001(?P<right>(?: \n)?)"
                       r"|\ue002(?P<json>.*?)\ue003", re.DOTALL)


def render_chat_parts(messages: list[ChatMessage], fmt: ChatFormat | str, *,
                      template: str | None = None, bos_text: str = "", eos_text: str = "",
                      bos_added: bool = True, tools: list | None = None) -> list[tuple[str, bool]]:
    """Prompt text for `messages` in `fmt`, ending where the assistant's reply should begin,
    as (text, is_content) parts: what the format wrote (its markers are special tokens) and
    the messages' contents (plain text whatever they spell).

    `bos_added`: the tokenizer puts BOS in front of the prompt, so a leading `bos_text` the
    template wrote is removed (else it would be there twice); without it, it stays. `tools`:
    OpenAI's function definitions, for a template that writes them (`template_tool_style`).
    """
    name = fmt.name if isinstance(fmt, ChatFormat) else fmt
    if (tools or any(m.role == "tool" or m.tool_calls for m in messages)) and name != "template":
        raise ConfigError(f"tools need the model's own chat template; the {name} format has none")
    if name == "transcript":  # plain text throughout: nothing in it is a marker
        return [(_strip_bos(_transcript(messages), bos_text, bos_added), True)]
    # An empty content stays empty: templates test it ("if message.content").
    stand_ins = [replace(m, content=f"{_PAD}\ue000{i}\ue001{_PAD}") if m.content else m
                 for i, m in enumerate(messages)]
    if name == "template":
        if not template:
            raise ConfigError("the template chat format needs the model's chat template")
        text = _render_template(template, stand_ins, bos_text, eos_text, tools)
    else:
        renderers = {"gemma": _gemma_turns, "llama3": _llama3_turns, "chatml": _chatml_turns,
                     "inst": _inst_turns}
        if name not in renderers:
            raise ConfigError(f"unknown chat format {name!r}")
        text = renderers[name](stand_ins)
    text = _strip_bos(text, bos_text, bos_added)
    parts, pos = [], 0
    for m in _SENTINEL.finditer(text):
        if m.group("json") is not None:
            content = m.group("json")
        else:
            content = messages[int(m.group("n"))].content
            if not m.group("left"):
                content = content.lstrip()
            if not m.group("right"):
                content = content.rstrip()
        parts += [(text[pos:m.start()], False), (content, True)]
        pos = m.end()
    parts.append((text[pos:], False))
    return [(t, is_content) for t, is_content in parts if t]


def _strip_bos(text: str, bos_text: str, bos_added: bool) -> str:
    if bos_added and bos_text and text.startswith(bos_text):
        return text[len(bos_text):]
    return text


# A conversation with one call and its result, rendered to see how the template writes calls
# (a 9-character id: Mistral's templates refuse others).
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn", "description": "d",
                                                "parameters": {"type": "object"}}}
_PROBE = [ChatMessage("user", "q"), ChatMessage("assistant", "", tool_calls=(
    {"id": "a1b2c3d4e", "type": "function",
     "function": {"name": "probe_fn", "arguments": {"probe_arg": 1}}},)),
    ChatMessage("tool", "r", tool_call_id="a1b2c3d4e"), ChatMessage("user", "q2")]


@functools.lru_cache(maxsize=8)
def template_tool_style(template: str | None) -> str | None:
    """The tool-call syntax a chat template writes, told by how it renders a call, for a
    template that renders `tools`: "hermes" (Qwen2.5, Hermes: <tool_call>{"name": ...,
    "arguments": {...}}</tool_call>), "mistral" ([TOOL_CALLS] [{"name": ..., "arguments":
    {...}}]) or "llama3" (Llama 3.1+: the reply is {"name": ..., "parameters": {...}});
    None otherwise."""
    if not template:
        return None
    from jinja2 import TemplateSyntaxError, meta

    try:
        names = meta.find_undeclared_variables(_template_env().parse(template))
    except TemplateSyntaxError:
        return None
    if "tools" not in names:
        return None
    try:
        text = _render_template(template, _PROBE, "", "", [_PROBE_TOOL])
    except ModelFormatError:  # a template that refuses this conversation's shape
        return None
    text = text.replace("\ue002", "").replace("\ue003", "")
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if re.search(r'\{"name": "probe_fn", "parameters": \{"probe_arg": 1\}\}', text):
        return "llama3"
    return None


def _message_dict(m: ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:  # absent otherwise: templates test "message.tool_calls"
        out["tool_calls"] = list(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _render_template(template: str, messages, bos_text: str, eos_text: str,
                     tools: list | None = None) -> str:
    from jinja2 import TemplateError

    try:
        return _template_env().from_string(template).render(
            messages=[_message_dict(m) for m in messages],
            bos_token=bos_text, eos_token=eos_text, add_generation_prompt=True,
            tools=tools or None, documents=None,  # as Hugging Face passes them
        )
    except TemplateError as exc:
        raise ModelFormatError("<chat template>", f"the model's chat template failed: {exc}") from None


def _template_env():
    """A sandbox with what files' templates call besides core Jinja (the names and behaviour
    Hugging Face's apply_chat_template provides): raise_exception, strftime_now (Llama 3.1+
    dates its system prompt), a tojson that keeps non-ASCII text and does not HTML-escape
    (its output marked as text for `render_chat_parts`), and {% break %} / {% continue %}."""
    import json
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False):
        # Marked as text (render_chat_parts): JSON of tools and arguments spells no markers.
        return "\ue002" + json.dumps(value, ensure_ascii=False, indent=indent,
                                      separators=separators, sort_keys=sort_keys) + "\ue003"

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = tojson
    return env


def _transcript(messages) -> str:
    # A system prompt replaces the preamble; the examples
    # stay, since they are what teaches a base model the turn shape and the reply length.
    system = "\n\n".join(m.content.strip() for m in messages if m.role == "system")
    turns = [f"{_USER} {q}\n{_ASSISTANT} {a}" for q, a in _EXAMPLES]
    for m in messages:
        if m.role == "user":
            turns.append(f"{_USER} {_one_paragraph(m.content)}")
        elif m.role == "assistant":
            turns[-1] += f"\n{_ASSISTANT} {_one_paragraph(m.content)}"
    return f"{system or _PREAMBLE}\n\n" + "\n\n".join(turns) + f"\n{_ASSISTANT}"


def _one_paragraph(text: str) -> str:
    """A turn's text without blank lines, which would read as the end of the turn."""
    return "\n".join(line for line in text.strip().splitlines() if line.strip())


def _gemma_turns(messages) -> str:
    # Gemma has no system role: the system prompt opens the first user turn.
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    parts = []
    for m in messages:
        if m.role == "system":
            continue
        content = m.content
        if system and m.role == "user":
            content, system = f"{system}\n\n{content}", ""
        role = "model" if m.role == "assistant" else "user"
        parts.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    return "".join(parts) + "<start_of_turn>model\n"


def _llama3_turns(messages) -> str:
    parts = [f"<|start_header_id|>{m.role}<|end_header_id|>\n\n{m.content}<|eot_id|>" for m in messages]
    return "".join(parts) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _chatml_turns(messages) -> str:
    parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def _inst_turns(messages) -> str:
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    text = ""
    for m in messages:
        if m.role == "user":
            content = f"{system}\n\n{m.content}" if system else m.content
            system = ""
            text += f"[INST] {content} [/INST]"
        elif m.role == "assistant":
            text += f" {m.content}\n"
    return text
