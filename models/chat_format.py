"""Turn a conversation into prompt text.

The model file's own `tokenizer.chat_template` (Jinja) is used when present, rendered in a
sandbox because templates come from downloaded files. Otherwise the family's turn format is
used: the default model is a base model and ships no template.
The result is tokenized with special tokens parsed; BOS is added by the tokenizer, so a
template's leading BOS text is removed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ModelFormatError


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


def render_chat(messages: list[ChatMessage], *, template: str | None, family: str,
                bos_text: str = "", eos_text: str = "", has_token=lambda t: False) -> str:
    """Prompt text for `messages`, ending where the assistant's reply should begin."""
    if template:
        text = _render_template(template, messages, bos_text, eos_text)
    elif family == "gemma3":
        text = _gemma_turns(messages)
    elif has_token("<|start_header_id|>"):
        text = _llama3_turns(messages)
    else:
        text = _inst_turns(messages)
    if bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]
    return text


def _render_template(template: str, messages, bos_text: str, eos_text: str) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            bos_token=bos_text, eos_token=eos_text, add_generation_prompt=True,
        )
    except TemplateError as exc:
        raise ModelFormatError("<chat template>", f"the model's chat template failed: {exc}") from None


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
