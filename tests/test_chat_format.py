"""Chat formats: the file's Jinja template (sandboxed), the transcript for base models, and
family turn formats on request."""

import pytest

from ember.models.chat_format import (CHAT_FORMATS, ChatFormat, ChatMessage, render_chat_parts,
                                      resolve_chat_format)
from ember.models.support.errors import ConfigError, ModelFormatError

MSGS = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")]


def render_chat(messages, fmt, **kw) -> str:
    return "".join(text for text, _ in render_chat_parts(messages, fmt, **kw))


def test_gemma_format_folds_system_into_first_user_turn():
    text = render_chat(MSGS, "gemma")
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_llama3_and_chatml_formats():
    text = render_chat(MSGS[1:2], "llama3")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" in text
    assert render_chat(MSGS[1:2], "chatml") == ("<|im_start|>user\nHi<|im_end|>\n"
                                                "<|im_start|>assistant\n")


def test_template_is_rendered_and_leading_bos_removed():
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    text = render_chat(MSGS[1:2], "template", template=template, bos_text="<s>")
    assert text == "[user]Hi[assistant]"


def test_template_errors_and_sandbox_escapes_are_format_errors():
    with pytest.raises(ModelFormatError, match="chat template"):
        render_chat(MSGS, "template", template="{{ raise_exception('no system role') }}")
    with pytest.raises(ModelFormatError, match="chat template"):
        render_chat(MSGS, "template", template="{{ ''.__class__.__mro__ }}")


def test_auto_is_the_template_when_the_file_has_one_else_the_transcript():
    assert resolve_chat_format("auto", has_template=True).name == "template"
    fmt = resolve_chat_format("auto", has_template=False, has_token=lambda t: True)
    assert fmt.name == "transcript" and "\nUser:" in fmt.stop_strings
    # A family format only when asked, even when its tokens are there.
    assert resolve_chat_format("gemma", has_template=True,
                               has_token=lambda t: t == "<start_of_turn>").name == "gemma"


def test_impossible_choices_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown --chat-format 'gemma2'; choose one of auto"):
        resolve_chat_format("gemma2", has_template=False)
    with pytest.raises(ConfigError, match="has no chat template"):
        resolve_chat_format("template", has_template=False)
    with pytest.raises(ConfigError, match=r"chatml needs the <\|im_start\|> token"):
        resolve_chat_format("chatml", has_template=False,
                            has_token=lambda t: t == "<start_of_turn>")
    assert set(CHAT_FORMATS) >= {"auto", "template", "transcript", "gemma", "llama3", "chatml"}


def test_transcript_has_examples_before_the_conversation_and_ends_at_the_reply():
    text = render_chat(MSGS[1:], ChatFormat("transcript"))
    head, _, convo = text.partition("User: Hi\n")
    assert head.count("User: ") == 2 and head.count("Assistant: ") == 2  # the two examples
    assert head.startswith("A chat between a curious user")
    assert convo == "Assistant: Hello.\n\nUser: Bye\nAssistant:"


def test_transcript_system_prompt_replaces_the_preamble_and_turns_lose_blank_lines():
    msgs = [ChatMessage("system", "Answer like a pirate."),
            ChatMessage("user", "Line one.\n\n\nLine two.")]
    text = render_chat(msgs, "transcript")
    assert text.startswith("Answer like a pirate.\n\nUser: ")
    assert "A chat between" not in text
    assert text.endswith("User: Line one.\nLine two.\nAssistant:")


def test_template_helpers_files_rely_on():
    """What Hugging Face's renderer gives templates besides core Jinja: strftime_now, a tojson
    that keeps non-ASCII text unescaped, {% break %}, and tools defined as none."""
    from datetime import datetime

    template = ("{{ strftime_now('%Y') }}|{{ {'q': 'café <b>'} | tojson }}|"
                "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}|"
                "{{ tools is none }}")
    text = render_chat(MSGS, "template", template=template)
    assert text == f'{datetime.now().year}|{{"q": "café <b>"}}|Be brief.|True'


def test_template_bos_stays_when_the_tokenizer_adds_none():
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render_chat(MSGS[1:2], "template", template=template, bos_text="<s>",
                       bos_added=False) == "<s>Hi"
    assert render_chat(MSGS[1:2], "template", template=template, bos_text="<s>") == "Hi"


def test_turn_ends_become_the_formats_stop_strings():
    fmt = resolve_chat_format("auto", has_template=True, turn_ends=("<|im_end|>", "<|end|>"))
    assert fmt.stop_strings == ("<|im_end|>", "<|end|>")
    transcript = resolve_chat_format("transcript", has_template=True, turn_ends=("<|end|>",))
    assert "<|end|>" not in transcript.stop_strings
