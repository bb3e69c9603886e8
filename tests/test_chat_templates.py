"""Chat templates from the file, per family (ChatML, Llama 3, Phi-3, Gemma): rendered through
the sandboxed Jinja renderer into the prompt ids the family expects, and each family's
end-of-turn token ending the reply without its text ever showing.

Each tiny model is a real GGUF (Ember's writer, a trained byte-level BPE vocabulary, the
template in tokenizer.chat_template) whose weights are set so that greedy decoding always
picks one chosen token: the end-of-turn token must then end generation at once.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest

from ember.models.testing import synthetic
from ember.models.chat_format import ChatMessage
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.decode.events import DoneEvent
from ember.offload.options.sampling import SamplingParams

from .synthetic_vocab import TYPE_USER_DEFINED, train_byte_level_vocab

DATA = Path(__file__).parent / "data"

# Templates written the way each family's files write theirs: the Jinja features they lean on
# (loop.first, slicing, filters, namespace-free sets, raise_exception, strftime_now, tojson).
CHATML = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- if tools %}{{- tools | tojson }}{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}
{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

PHI3 = ("{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
        "{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>' + '\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

MSGS = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"),
        ChatMessage("assistant", "Hello."), ChatMessage("user", "Count to 3")]


def _today() -> str:
    return datetime.now().strftime("%d %b %Y")


# family -> (template, pre, bos, eos, add_bos, end-of-turn token, expected prompt text)
FAMILIES = {
    "chatml": (CHATML, "qwen2", "<|endoftext|>", "<|im_end|>", False, "<|im_end|>", lambda: (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nCount to 3<|im_end|>\n"
        "<|im_start|>assistant\n")),
    "llama3": (LLAMA3, "llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", True, "<|eot_id|>",
               lambda: (
        "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + _today() + "\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCount to 3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")),
    "phi3": (PHI3, "gpt-2", "<|endoftext|>", "<|endoftext|>", False, "<|end|>", lambda: (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello.<|end|>\n"
        "<|user|>\nCount to 3<|end|>\n<|assistant|>\n")),
    "gemma": (GEMMA, "default", "<bos>", "<eos>", True, "<end_of_turn>", lambda: (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
        "Hello.<end_of_turn>\n<start_of_turn>user\nCount to 3<end_of_turn>\n"
        "<start_of_turn>model\n")),
}


@pytest.fixture(scope="module")
def base_vocab():
    texts = [(DATA / "english.txt").read_text(), (DATA / "mixed_scripts.txt").read_text()]
    return train_byte_level_vocab(texts, size=600)


def always_emits(weights: dict, cfg, token: int, dim: int = 0) -> dict:
    """Weights whose greedy choice is `token` at every position: dimension `dim` of the
    residual stream is a constant +4 (every embedding has it, no layer writes it), the final
    norm keeps only that dimension, and only `token`'s output row reads it."""
    w = {k: v.clone() for k, v in weights.items()}
    w["token_embd.weight"][:, dim] = 4.0
    for i in range(cfg.n_layers):
        w[f"blk.{i}.attn_output.weight"][dim, :] = 0.0
        w[f"blk.{i}.ffn_down.weight"][dim, :] = 0.0
    w["output_norm.weight"].zero_()
    w["output_norm.weight"][dim] = 1.0
    w["output.weight"].zero_()
    w["output.weight"][token, dim] = 1.0
    return w


def family_engine(tmp_path, vocab, family: str, emit: str | None = None) -> Engine:
    template, pre, bos, eos, add_bos, _, _ = FAMILIES[family]
    vocab = replace(vocab, pre=pre, bos=bos, eos=eos, add_bos=add_bos)
    # A neutral name: llama.cpp gives Phi-3-named files special-token rules of their own.
    cfg = synthetic.tiny_config("llama", vocab_size=len(vocab.tokens),
                                name=f"tiny-chat-{sorted(FAMILIES).index(family)}")
    weights = synthetic.tiny_weights(cfg, seed=3)
    if emit is not None:
        weights = always_emits(weights, cfg, vocab.id_of(emit))
    path = synthetic.write_gguf(tmp_path / f"{family}.gguf", cfg, weights, vocab=vocab,
                                chat_template=template)
    return Engine(load_model(path), EngineOptions(device="cpu", n_ctx=256, threads=1))


GREEDY = SamplingParams(temperature=0.0)


def run(engine, prompt, **kw) -> DoneEvent:
    return engine.generate(prompt, sampling=GREEDY, max_tokens=6, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_template_renders_the_family_prompt(family, base_vocab, tmp_path):
    engine = family_engine(tmp_path, base_vocab, family)
    *_, add_bos, _, expected = FAMILIES[family]
    prompt = engine.encode_chat(MSGS)
    assert prompt.format.name == "template"
    tok = engine.tokenizer
    want = tok.encode(expected(), parse_special=True)
    assert list(prompt) == want
    # BOS exactly once, where the family wants it: the template's own is not doubled.
    assert prompt.count(tok.bos_id) == (1 if add_bos else 0)
    assert add_bos == (prompt[0] == tok.bos_id)
    # Every turn marker is one control token, never spelled out in pieces.
    marker = FAMILIES[family][5]
    assert prompt.count(tok.id_of(marker)) == expected().count(marker)


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_token_ends_the_reply(family, base_vocab, tmp_path):
    end = FAMILIES[family][5]
    engine = family_engine(tmp_path, base_vocab, family, emit=end)
    done = run(engine, engine.encode_chat(MSGS))
    assert (done.finish_reason, done.text, done.token_ids) == ("eos", "", [])
    # The same model told to ignore EOS really does write that token (so the stop above was
    # the token's doing) and its text never shows.
    forced = run(engine, engine.encode_chat(MSGS), ignore_eos=True)
    assert forced.token_ids and set(forced.token_ids) == {engine.tokenizer.id_of(end)}
    assert end not in forced.text


def test_a_model_that_writes_ordinary_text_is_not_stopped(base_vocab, tmp_path):
    """The control: a model emitting an ordinary word runs to max_tokens."""
    word = next(t for t in base_vocab.tokens if t.isalpha() and t.isascii() and len(t) >= 3)
    engine = family_engine(tmp_path, base_vocab, "chatml", emit=word)
    done = run(engine, engine.encode_chat(MSGS))
    assert done.finish_reason == "length" and done.text == word * 6


def test_end_of_turn_typed_as_user_defined_still_ends_and_never_shows(base_vocab, tmp_path):
    """Some Phi-3 conversions type <|end|> as user-defined (llama.cpp ends generation at it by
    its text all the same). Such a token decodes to its text, so with EOS ignored the
    template's stop strings must keep "<|end|>" out of the reply."""
    vocab = replace(base_vocab, types=list(base_vocab.types))
    vocab.types[vocab.id_of("<|end|>")] = TYPE_USER_DEFINED
    engine = family_engine(tmp_path, vocab, "phi3", emit="<|end|>")
    assert engine.tokenizer.token_bytes(vocab.id_of("<|end|>")) == b"<|end|>"
    assert run(engine, engine.encode_chat(MSGS)).finish_reason == "eos"
    forced = run(engine, engine.encode_chat(MSGS), ignore_eos=True)
    assert (forced.finish_reason, forced.text) == ("stop", "")


def test_file_named_end_of_turn_ids_stop(base_vocab, tmp_path):
    """tokenizer.ggml.eot_token_id / eom_token_id name stop tokens whatever their text."""
    vocab = replace(base_vocab, extra={"eom_token_id": "<tool_call>"})
    engine = family_engine(tmp_path, vocab, "llama3", emit="<tool_call>")
    assert vocab.id_of("<tool_call>") in engine.stop_ids
    assert run(engine, engine.encode_chat(MSGS)).finish_reason == "eos"


def test_template_errors_reach_the_user(base_vocab, tmp_path):
    engine = family_engine(tmp_path, base_vocab, "gemma")
    from ember.models.support.errors import ModelFormatError

    bad = [ChatMessage("user", "a"), ChatMessage("user", "b")]  # Gemma wants alternation
    with pytest.raises(ModelFormatError, match="roles must alternate"):
        engine.encode_chat(bad)


def test_stop_ids_cover_llama_cpp_end_of_generation(base_vocab, tmp_path):
    """Every token llama.cpp ends generation at (llama_vocab_is_eog) stops Ember too."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp baseline is not installed")
    for family in FAMILIES:
        engine = family_engine(tmp_path, base_vocab, family)
        llm = llama_cpp.Llama(str(engine.loaded.source.path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        assert eog and eog <= engine.stop_ids, family


def test_cli_info_and_generate_chat_on_a_chatml_file(base_vocab, tmp_path, capsys):
    from ember.app.cli import main

    engine = family_engine(tmp_path, base_vocab, "chatml", emit="<|im_end|>")
    path = str(engine.loaded.source.path)
    assert main(["info", "--model", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["chat_format"]["auto"] == "template"
    assert info["tokenizer"]["kind"] == "byte-level BPE, pre-tokenizer qwen2"
    assert info["tokenizer"]["bos"] is None and "<|im_end|>" in info["tokenizer"]["stop_tokens"]
    assert main(["info", "--model", path]) == 0
    assert "pre-tokenizer qwen2; BOS none; a reply ends at <|im_end|>" in capsys.readouterr().out
    assert main(["generate", "Hi", "--model", path, "--chat", "--json", "--temperature", "0",
                 "--max-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["finish_reason"], out["text"], out["chat_format"]) == ("eos", "", "template")
    tail = engine.tokenizer.encode("<|im_start|>assistant\n", add_bos=False, parse_special=True)
    assert out["prompt_token_ids"][-len(tail):] == tail


def test_hf_folder_chat_template_and_stop_ids(tiny_models, tmp_path):
    """Hugging Face folders: a named template list ("default" used), chat_template.jinja for
    folders that keep it apart, and every eos_token_id of the configs ends a reply."""
    from ember.models.loader import open_model

    folder = Path(shutil.copytree(tiny_models["llama-silu_glu"][3], tmp_path / "hf"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools!"}, {"name": "default", "template": GEMMA}]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5, 10**9]}))
    source = open_model(folder)
    assert source.chat_template == GEMMA
    assert {1, 5} <= set(source.stop_ids) and 10**9 not in source.stop_ids
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text(CHATML)
    assert open_model(folder).chat_template == CHATML
