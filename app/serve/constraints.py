"""What a request's reply must match, from whichever field the client used.

OpenAI's `response_format`; llama.cpp server's `grammar` (GBNF) and `json_schema`; vLLM's
extra-body `guided_json`, `guided_regex`, `guided_choice` (a list of strings) and
`guided_grammar` (GBNF or Lark). Each becomes one `Grammar` that llguidance compiles
(offload/decode/grammar.py); a request gives at most one of them.
"""

from __future__ import annotations

import json

from ember.offload.options.sampling import Grammar

from .errors import ApiError

# The raw constraint fields beside response_format (protocol.py reads that one's shape).
FIELDS = ("grammar", "json_schema", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar")
MAX_CHOICES = 1024


def constraint(body: dict, response_format: Grammar | None) -> tuple[str | None, Grammar | None]:
    """(the field that constrains the reply, its grammar), or (None, None); a 400 when two
    fields constrain it or one is malformed. `response_format`: that field, already read."""
    given = [name for name in FIELDS if body.get(name) is not None]
    if response_format is not None:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ApiError(400, f"{given[0]} and {given[1]} both constrain the reply: give one",
                       param=given[1])
    if not given:
        return None, None
    name = given[0]
    if name == "response_format":
        return name, response_format
    return name, _READERS[name](body[name], name)


def _json_schema(value, name: str) -> Grammar:
    """A schema object, or (vLLM takes both) its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise _bad(f"{name} must be a JSON schema (an object, or its JSON text)",
                       name) from None
    if not isinstance(value, (dict, bool)):
        raise _bad(f"{name} must be a JSON schema (an object, or its JSON text)", name)
    return Grammar("json_schema", json.dumps(value))


def _text(kind: str):
    def read(value, name: str) -> Grammar:
        if not isinstance(value, str) or not value.strip():
            raise _bad(f"{name} must be a non-empty string ({_KIND_NAMES[kind]})", name)
        return Grammar(kind, value)
    return read


def _choice(value, name: str) -> Grammar:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(s, str) and s for s in value)):
        raise _bad(f"{name} must be a list of 1 to {MAX_CHOICES} non-empty strings", name)
    # Lark string literals take JSON's escapes: each choice is text, whatever it spells.
    return Grammar("lark", "start: " + " | ".join(json.dumps(s) for s in dict.fromkeys(value)))


_KIND_NAMES = {"gbnf": "a GBNF or Lark grammar", "regex": "a regular expression"}
_READERS = {"grammar": _text("gbnf"), "json_schema": _json_schema, "guided_json": _json_schema,
            "guided_regex": _text("regex"), "guided_choice": _choice,
            "guided_grammar": _text("gbnf")}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)
