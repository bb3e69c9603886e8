"""Request bodies of the OpenAI API, read and checked into a `GenerationRequest`.

Every field Ember does not implement is answered with a 400 naming it, never ignored: a client
asking for n=3 or for audio must learn that it will not get them. Fields that only label a
request (`user`, `metadata`, `store`) are accepted and unused. A few llama.cpp-server fields
are accepted as extensions (top_k, min_p, repeat_penalty, ignore_eos), and the constraint
fields of llama.cpp's and vLLM's servers (constraints.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ember.models.chat_format import ChatMessage
from ember.models.support.errors import ConfigError
from ember.offload.options.sampling import MAX_TOP_LOGPROBS, Grammar, SamplingParams

from .constraints import FIELDS as CONSTRAINT_FIELDS, constraint
from .errors import ApiError

# Sampling defaults are Ember's own (llama.cpp's): top_k 40 and min_p 0.05 stay on unless
# the request turns them off, whatever temperature it sets.
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
_COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "ignore_eos",
           "user", "metadata", "store", "response_format", *CONSTRAINT_FIELDS, *_SAMPLING}
# tools and tool_choice are read by tools.py
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
MAX_STOP_STRINGS = 8
MAX_LOGIT_BIAS = 300  # OpenAI's limit on entries
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit

# name -> the values that ask for nothing (any other is a feature Ember lacks)
_NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",),
            "functions": ([],), "function_call": ("none",), "modalities": (["text"],), "audio": (),
            "prediction": (), "reasoning_effort": (), "web_search_options": (),
            "service_tier": ("auto", "default")}
# name -> (accepted, what the message says)
_RANGES = {"temperature": (lambda v: 0 <= v <= 2, "between 0 and 2 (0 is greedy)"),
           "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1 turns it off)"),
           "presence_penalty": (lambda v: -2 <= v <= 2, "between -2 and 2 (0 turns it off)"),
           "frequency_penalty": (lambda v: -2 <= v <= 2, "between -2 and 2 (0 turns it off)"),
           "min_p": (lambda v: 0 <= v < 1, "in [0, 1) (0 turns it off)"),
           "repeat_penalty": (lambda v: v > 0, "> 0 (1 turns it off)")}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


@dataclass
class GenerationRequest:
    """One checked request: a conversation (chat) or a prompt (completion) and how to sample."""

    kind: str  # "chat" or "completion"
    messages: list[ChatMessage] = field(default_factory=list)  # chat
    prompt: str | list[int] = ""  # completion: text, or token ids as given
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the server's default
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool = False
    tools: object = None  # chat: a tools.ToolRequest when the model may call functions
    constrained_by: str | None = None  # the field whose grammar the reply must match


def parse_chat(body, model_id: str) -> GenerationRequest:
    _check_fields(body, CHAT_FIELDS, model_id)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise _bad("give max_tokens or max_completion_tokens, not both", "max_tokens")
    request = GenerationRequest("chat", messages=_messages(body.get("messages")))
    if "max_completion_tokens" in body:
        request.max_tokens = _int(body, "max_completion_tokens", low=1)
    return _common(body, request)


def parse_completion(body, model_id: str) -> GenerationRequest:
    _check_fields(body, COMPLETION_FIELDS, model_id)
    return _common(body, GenerationRequest("completion", prompt=_prompt(body.get("prompt"))))


def _check_fields(body, allowed: set[str], model_id: str) -> None:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, value in body.items():
        if name in _NEUTRAL:
            if value is not None and value not in _NEUTRAL[name]:
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                why = ("Ember gives one choice per request: send n requests instead"
                       if name in ("n", "best_of") else "it is not supported by Ember")
                raise _bad(f"{name}={shown}: {why}", name, "unsupported_parameter")
        elif name not in allowed:
            raise _bad(f"Unrecognized request argument supplied: {name}", name,
                       "unknown_parameter")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"The model {model!r} does not exist; this server runs "
                            f"{model_id!r} (see GET /v1/models)", param="model",
                       code="model_not_found")


def _messages(value) -> list[ChatMessage]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                       f"{where}.role")
        allowed = {"role", "content", "name"} | _ROLE_FIELDS.get(role, set())
        extra = set(m) - allowed
        if extra:
            raise _bad(f"{where}: {', '.join(sorted(extra))} not supported for a {role} message",
                       f"{where}.{sorted(extra)[0]}", "unsupported_parameter")
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
        content = m.get("content")
        if content is None and calls:  # an assistant's turn that only calls tools
            content = ""
        call_id = m.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise _bad(f"{where}: a tool message needs the tool_call_id it answers",
                       f"{where}.tool_call_id")
        out.append(ChatMessage(_ROLES[role], _content(content, f"{where}.content"),
                               tool_calls=calls, tool_call_id=call_id))
    return out


_ROLE_FIELDS = {"assistant": {"tool_calls", "refusal"}, "tool": {"tool_call_id"}}


def _tool_calls(value, where: str) -> tuple:
    """An assistant's earlier calls, arguments parsed back to objects (what templates
    write with tojson)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise _bad(f"{where} must be a list of function calls", where)
    calls = []
    for n, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str)):
            raise _bad(f"{where}[{n}] must be {{id, type: function, function: {{name, "
                       "arguments (a JSON string)}}}}", f"{where}[{n}]")
        try:
            arguments = json.loads(fn.get("arguments", "{}"))
        except (ValueError, RecursionError):
            arguments = fn["arguments"]  # written as given
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return tuple(calls)


def _content(value, where: str) -> str:
    """A string, or a list of text parts joined (images and audio are not supported)."""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                           "are supported", where, "unsupported_parameter")
            texts.append(_text(part["text"], where))
        return "\n".join(texts)
    raise _bad(f"{where} must be a string or a list of text parts", where)


def _prompt(value) -> str | list[int]:
    """Text, one text in a list, or one list of token ids (several prompts: not supported)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return _text(value, "prompt")
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        return list(value)
    raise _bad("prompt must be a non-empty string or one list of token ids (one prompt per "
               "request)", "prompt")


def _common(body: dict, request: GenerationRequest) -> GenerationRequest:
    if "max_tokens" in body:
        request.max_tokens = _int(body, "max_tokens", low=1)
    request.stop = _stop(body.get("stop"))
    request.stream = _bool(body, "stream")
    request.ignore_eos = _bool(body, "ignore_eos")
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options supports only include_usage", "stream_options")
        request.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    request.constrained_by, grammar = constraint(body, _response_format(
        body.get("response_format")))
    if grammar is not None and request.ignore_eos:
        raise _bad(f"{request.constrained_by} ends the reply where its grammar is complete: it "
                   "cannot be combined with ignore_eos", "ignore_eos")
    request.sampling = _sampling(body, request.kind, grammar)
    return request


def _sampling(body: dict, kind: str, grammar: Grammar | None) -> SamplingParams:
    given = {}
    for name in _RANGES:
        if body.get(name) is not None:
            given[name] = _number(body, name)
    if body.get("top_k") is not None:
        given["top_k"] = _int(body, "top_k", low=0)
    if body.get("seed") is not None:
        given["seed"] = _int(body, "seed", low=-2**63, high=2**64 - 1)  # torch's seed range
    if body.get("logit_bias") is not None:
        given["logit_bias"] = _logit_bias(body["logit_bias"])
    given["logprobs"] = _logprobs(body, kind)
    given["grammar"] = grammar
    try:
        return SamplingParams(**given)
    except ConfigError as exc:  # the ranges above are SamplingParams' own; kept as a net
        raise _bad(str(exc)) from None


def _response_format(value) -> Grammar | None:
    """text (None), json_object (any JSON object) or json_schema (its `schema`)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Grammar("json_schema", '{"type": "object"}')
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if (isinstance(spec, dict) and isinstance(spec.get("name"), str)
                and isinstance(spec.get("schema", {}), dict)
                and set(spec) <= {"name", "description", "schema", "strict"}):
            return Grammar("json_schema", json.dumps(spec.get("schema", {})))
        raise _bad("response_format.json_schema must be {name, schema, description?, strict?} "
                   "with schema a JSON object", "response_format.json_schema")
    raise _bad('response_format must be {"type": "text"}, {"type": "json_object"} or '
               '{"type": "json_schema", "json_schema": {...}}', "response_format")


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to biases",
                   "logit_bias")
    out = []
    for key, bias in value.items():
        if (not (key.isascii() and key.isdigit() and len(key) <= 9)
                or not isinstance(bias, (int, float)) or isinstance(bias, bool)
                or not -100 <= bias <= 100):
            raise _bad(f"logit_bias maps token ids (as strings) to numbers between -100 and "
                       f"100, got {key[:20]!r}: {bias!r}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top log-probabilities per token (None: none asked). Chat: logprobs true and
    top_logprobs 0-20; completions: logprobs 0-5."""
    value = body.get("logprobs")
    if kind == "completion":  # the legacy API: an integer
        if value is None:
            return None
        return _int(body, "logprobs", low=0, high=MAX_COMPLETION_LOGPROBS)
    wanted = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    top = _int(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if not wanted:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return top


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise _bad(f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS}",
                   "stop")
    return tuple(_text(s, "stop") for s in stops)


def _text(value: str, where: str) -> str:
    """`value` if it is valid Unicode: JSON's escapes can spell a lone surrogate, which no
    tokenizer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                   "escape), which is not text", where) from None
    return value


def _int(body: dict, name: str, low: int | None = None, high: int | None = None) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(f"{name} must be {_range(low, high)}, got {value}", name)
    return value


def _number(body: dict, name: str) -> float:
    value = body.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _bad(f"{name} must be a number, got {value!r}", name)
    accepted, says = _RANGES[name]
    if not accepted(value):  # NaN fails too
        raise _bad(f"{name} must be {says}, got {value}", name)
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{param or name} must be true or false, got {value!r}", param or name)
    return value


def _range(low, high) -> str:
    return f">= {low}" if high is None else f"between {low} and {high}"


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
