"""Tool calls in Llama 3.1's and Mistral's syntaxes, told from how each template renders a call:
tiny models with templates written for these tests in those families' shapes (their call
markers, `<|python_tag|>` and `[TOOL_CALLS]`, control tokens as in the families' files). Forced
and auto calls validate, whole and streamed; earlier calls and tool results go back through
the template; the readers alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from starlette.testclient import TestClient  # noqa: E402

from ember.app.serve.call_stream import CallStream  # noqa: E402
from ember.app.serve.call_syntax import read_calls  # noqa: E402
from ember.app.serve.server import create_app  # noqa: E402
from ember.app.serve.worker import EngineWorker  # noqa: E402
from ember.models.chat_format import template_tool_style  # noqa: E402
from ember.models.loader import load_model  # noqa: E402
from ember.models.testing import synthetic  # noqa: E402
from ember.offload.runtime.engine import Engine, EngineOptions  # noqa: E402

from .synthetic_vocab import TYPE_CONTROL  # noqa: E402
from .test_chat_templates import base_vocab  # noqa: E402,F401
from .test_serve_tools import ASK, HERMES, TOOLS, _valid, merged_calls  # noqa: E402

LLAMA31 = """{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\nReply with {"name": function name, "parameters": '
   'dictionary of arguments} to call one of:\\n' }}
{%- for t in tools %}{{- t | tojson + '\\n\\n' }}{%- endfor %}{%- endif %}{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}{{- raise_exception('Tool call IDs must be 9 characters') }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}{{- ']' + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] ' + message.content + '[/TOOL_RESULTS]' }}
{%- else %}{{- ' ' + message.content + eos_token }}
{%- endif %}{%- endfor %}"""

MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")
# style -> (template, eos, bos, the token a bias makes the tiny model open a call with)
STYLES = {"llama3": (LLAMA31, "<|eot_id|>", "<|begin_of_text|>", "{"),
          "mistral": (MISTRAL, "</s>", "<s>", "[TOOL_CALLS]")}


def test_the_syntax_is_told_by_how_the_template_renders_a_call():
    assert template_tool_style(HERMES) == "hermes"
    assert template_tool_style(LLAMA31) == "llama3"
    assert template_tool_style(MISTRAL) == "mistral"
    no_tools = LLAMA31.replace("tools", "nothing")
    assert template_tool_style(no_tools) is None


@pytest.fixture(scope="module", params=list(STYLES))
def served(request, base_vocab, tmp_path_factory):  # noqa: F811
    style = request.param
    template, eos, bos, _ = STYLES[style]
    vocab = replace(base_vocab, tokens=base_vocab.tokens + list(MARKERS),
                    types=base_vocab.types + [TYPE_CONTROL] * len(MARKERS), pre="llama-bpe",
                    bos=bos, eos=eos, add_bos=True)
    cfg = synthetic.tiny_config("llama", vocab_size=len(vocab.tokens), name=f"tiny-{style}",
                                context_length=1024)
    path = synthetic.write_gguf(tmp_path_factory.mktemp(style) / f"{style}.gguf", cfg,
                                synthetic.tiny_weights(cfg, seed=5), vocab=vocab,
                                chat_template=template)
    engine = Engine(load_model(path), EngineOptions(device="cpu", n_ctx=1024, threads=1))
    worker = EngineWorker(engine)
    yield style, engine, TestClient(create_app(worker, f"tiny-{style}"))
    worker.close()


def _post(client, body: dict, stream: bool):
    r = client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"].get("tool_calls") or [], choice["finish_reason"]
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    return (merged_calls([e["choices"][0]["delta"] for e in events]),
            events[-1]["choices"][0]["finish_reason"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_and_auto_calls_are_valid(served, stream):
    style, engine, client = served
    assert engine.tool_style == style
    opener = engine.tokenizer.id_of(STYLES[style][3])
    for extra in ({"tool_choice": "required"},
                  {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                  # auto: the bias opens a call (one: the tiny model would not stop at one)
                  {"logit_bias": {str(opener): 100}, "parallel_tool_calls": False}):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
            calls, finish = _post(client, {"messages": ASK, "tools": TOOLS, "max_tokens": 80,
                                           **extra, **sampling}, stream)
            assert finish == "tool_calls" and calls, (extra, sampling)
            for call in calls:
                _valid({"type": "function", **call}, id_prefix="call_" if style == "llama3" else "")
                assert style != "mistral" or (len(call["id"]) == 9 and call["id"].isalnum())
            if "function" in extra.get("tool_choice", ""):
                assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_auto_without_a_call_is_text(served):
    style, _, client = served
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS,
                                                  "max_tokens": 8, "temperature": 0})
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and message["content"] and "tool_calls" not in message


def test_a_follow_up_turn_goes_back_through_the_template(served):
    style, engine, client = served
    calls, _ = _post(client, {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                              "max_tokens": 80, "temperature": 0}, False)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                  "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    from ember.models.chat_format import ChatMessage

    prompt = engine.tokenizer.decode(engine.encode_chat([
        ChatMessage("user", ASK[0]["content"]),
        ChatMessage("assistant", "", tool_calls=({"id": calls[0]["id"], "type": "function",
                                                  "function": {**calls[0]["function"],
                                                               "arguments": json.loads(
                                                                   calls[0]["function"]
                                                                   ["arguments"])}},)),
        ChatMessage("tool", "18 C", tool_call_id=calls[0]["id"])], tools=TOOLS))
    key = "parameters" if style == "llama3" else "arguments"
    assert f'"name": "{calls[0]["function"]["name"]}", "{key}": ' in prompt and "18 C" in prompt


def test_readers_and_streams_of_each_syntax():
    names = {"f"}
    assert read_calls("llama3", '{"name": "f", "parameters": {"a": 1}}', names)[1][0][
        "function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert read_calls("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', names)[1]
    assert read_calls("llama3", '{"name": "g", "parameters": {}}', names)[1] == []
    assert read_calls("llama3", "plain", names) == ("plain", [])
    content, calls = read_calls("mistral", 'ok [TOOL_CALLS] [{"name": "f", "arguments": {}}, '
                                           '{"name": "f", "arguments": {"b": 2}}]', names)
    assert content == "ok" and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{}, {"b": 2}]
    # the control token leaves no text: the list alone is read
    assert len(read_calls("mistral", ' [{"name": "f", "arguments": {}}]', names)[1]) == 1
    assert read_calls("mistral", "[1, 2]", names) == ("[1, 2]", [])
    stream = CallStream(names, "mistral")
    items = [i for p in ["Sure. ", "[TOOL", "_CALLS] [{", '"name": "f", "arguments": {}}]']
             for i in stream.push(p)]
    assert "".join(i[1] for i in items if i[0] == "content") == "Sure. "
    assert [i[0] for i in items] == ["content"] and stream.finish()[0][2]["function"][
        "name"] == "f"
    bare = CallStream(names, "llama3")
    assert bare.push('{"name": "f", ') == [] and bare.push('"parameters": {}}') == []
    assert bare.finish()[0][2]["function"]["name"] == "f"
