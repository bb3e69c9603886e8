"""Constrained decoding with llguidance on a tiny ChatML model (a byte-level vocabulary, so any
JSON can be spelled): replies match their JSON schema, regex or Lark grammar; speculative
decoding stays lossless under a grammar (drafts that break it are rejected); what llguidance
cannot compile is a ConfigError; `ember generate --json-schema / --grammar`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ember.models.chat_format import ChatMessage
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.offload.options.sampling import Grammar, SamplingParams
from ember.offload.runtime.engine import Engine, EngineOptions

from .test_chat_templates import base_vocab, family_engine  # noqa: F401

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "pet", "tags"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "pet": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 6}}}}
JSON_GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))
# A prompt with JSON in it, so the lookup drafter proposes continuations of it, some of which
# break the schema (a key it lacks, a pet it does not allow) and must be rejected.
PROMPT = [ChatMessage("user", 'like {"n": 5, "pet": "cow", "legs": 4} or {"n": 12, "pet": '
                              '"cat", "tags": ["a", "b"]} or {"n": 7, "pet": "dog", "tags": []}')]
SAMPLINGS = [SamplingParams(temperature=0, grammar=JSON_GRAMMAR),
             SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=4,
                            grammar=JSON_GRAMMAR)]


@pytest.fixture(scope="module")
def chatml(base_vocab, tmp_path_factory):  # noqa: F811
    return family_engine(tmp_path_factory.mktemp("grammar"), base_vocab, "chatml")


def _reply(engine, sampling, n=80):
    return engine.generate(engine.encode_chat(PROMPT), sampling=sampling, max_tokens=n)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_json_schema_replies_validate(chatml, sampling):
    done = _reply(chatml, sampling)
    assert done.finish_reason == "eos", done.text
    jsonschema.validate(json.loads(done.text), SCHEMA)
    unconstrained = _reply(chatml, SamplingParams(temperature=0), 20)
    with pytest.raises(ValueError):  # the control: the model alone writes no JSON
        json.loads(unconstrained.text)


def test_regex_and_lark_grammars(chatml):
    regex = _reply(chatml, SamplingParams(temperature=0, grammar=Grammar(
        "regex", r"(yes|no), [a-z]{2,5}\.")))
    assert regex.finish_reason == "eos"
    import re

    assert re.fullmatch(r"(yes|no), [a-z]{2,5}\.", regex.text)
    marker = chatml.tokenizer.id_of("<tool_call>")
    for rule, first_is_marker in (('<tool_call>', True), ('"<tool_call>"', False)):
        lark = _reply(chatml, SamplingParams(temperature=1.0, seed=1, grammar=Grammar(
            "lark", f'start: {rule} name\nname: "go" | "stop"')))
        # a marker the grammar names is the vocabulary's token; quoted, it is text
        assert (lark.token_ids[0] == marker) == first_is_marker
        assert lark.text in ("<tool_call>go", "<tool_call>stop")


@pytest.mark.parametrize("mode", ["lookup", "self"])
def test_speculation_under_a_grammar_is_lossless(chatml, mode):
    path = chatml.loaded.source.path
    spec = Engine(load_model(path), EngineOptions(device="cpu", n_ctx=256, threads=1,
                                                  speculate=mode, tree="2,1,1"))
    rejected = 0
    for sampling in SAMPLINGS:
        plain, drafted = _reply(chatml, sampling), _reply(spec, sampling)
        assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
        stats = spec.speculation
        drafted = sum(stats["tree_nodes_per_step"]) - len(stats["tree_nodes_per_step"])
        assert drafted > 0
        rejected += drafted - sum(stats["accepted_per_step"])
    assert rejected > 0  # drafts the grammar (or the target) did not take


@pytest.mark.parametrize("grammar", [
    Grammar("json_schema", '{"type": "strin"}'),
    Grammar("json_schema", '{"$ref": "#/nowhere"}'),
    Grammar("json_schema", "not json"),
    Grammar("regex", "(unclosed"),
    Grammar("lark", "start: undefined_rule"),
])
def test_what_cannot_compile_is_a_config_error(chatml, grammar):
    with pytest.raises(ConfigError, match="cannot be compiled"):
        chatml.check_sampling(SamplingParams(grammar=grammar))


def test_a_grammar_refuses_ignore_eos(chatml):
    with pytest.raises(ConfigError, match="ignore_eos"):
        chatml.stream([1, 2], sampling=SamplingParams(grammar=JSON_GRAMMAR), ignore_eos=True)


def test_generate_json_schema_and_grammar_files(chatml, tmp_path, capsys):
    from ember.app.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: ("yes" | "no") "!"\n')
    model = str(chatml.loaded.source.path)
    common = ["--model", model, "--json", "--temperature", "0", "--max-tokens", "60",
              "--ctx-size", "256", "--device", "cpu"]
    assert main(["generate", "x", "--chat", "--json-schema", str(schema), *common]) == 0
    jsonschema.validate(json.loads(json.loads(capsys.readouterr().out)["text"]), SCHEMA)
    assert main(["generate", "x", "--grammar", str(grammar), *common]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes!", "no!")
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "."\n')
    assert main(["generate", "x", "--grammar", str(gbnf), *common]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes.", "no.")
    assert main(["generate", "x", "--regex", "[0-9]{3}-[0-9]{4}", *common]) == 0
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", json.loads(capsys.readouterr().out)["text"])
    assert main(["generate", "x", "--regex", "[0-9", *common]) == 2
    assert "regex cannot be compiled" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": 3}')
    assert main(["generate", "x", "--json-schema", str(bad), *common]) == 2
