"""Chat formatting: the file's Jinja template when present (sandboxed), else family turns."""

import pytest

from ember.models.chat_format import ChatMessage, render_chat
from ember.models.errors import ModelFormatError

MSGS = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")]


def test_gemma_fallback_folds_system_into_first_user_turn():
    text = render_chat(MSGS, template=None, family="gemma3")
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_llama3_fallback_when_vocab_has_header_tokens():
    text = render_chat(MSGS[1:2], template=None, family="llama",
                       has_token=lambda t: t == "<|start_header_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" in text


def test_template_is_rendered_and_leading_bos_removed():
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    text = render_chat(MSGS[1:2], template=template, family="llama", bos_text="<s>")
    assert text == "[user]Hi[assistant]"


def test_template_errors_and_sandbox_escapes_are_format_errors():
    with pytest.raises(ModelFormatError, match="chat template"):
        render_chat(MSGS, template="{{ raise_exception('no system role') }}", family="llama")
    with pytest.raises(ModelFormatError, match="chat template"):
        render_chat(MSGS, template="{{ ''.__class__.__mro__ }}", family="llama")
