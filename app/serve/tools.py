"""OpenAI tool calling over a model's own chat template.

The request's `tools` go to the template (which writes them as the model was trained to see
them); the reply is read back in the template's call syntax: here the Hermes syntax
Qwen2.5 uses, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
call; Llama 3's and Mistral's in call_syntax.py. `tool_choice` "required" or a named function forces a call: a Lark grammar (llguidance)
admits only a call block whose JSON names an allowed function with arguments valid under its
`parameters` schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Callable

from ember.offload.options.sampling import Grammar

from .call_syntax import call_id, call_schema, read_calls, syntax_grammar
from .errors import ApiError
from .protocol import GenerationRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# JSON as the template writes it (and as the model learned it): ", " and ": "
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass
class ToolRequest:
    """The request's functions (as given: what the template writes) and what it wants:
    "auto" (the model chooses), "required" (some call) or one function's name."""

    tools: list[dict]
    choice: str
    parallel: bool = True  # parallel_tool_calls: more than one call per reply

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools` and `tool_choice` checked; None without tools or with tool_choice "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad_request("tools must be a list of up to 128 function tools", "tools")
    names = [_function_name(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise bad_request("tools name the same function twice", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(tools, choice or "auto", parallel)
    if choice == "none":
        return None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": NAME}} naming one of the tools',
                          "tool_choice")
    return ToolRequest(tools, name, parallel)


def apply_tools(req: GenerationRequest, style: str | None, tokenizer, model_id: str) -> None:
    """Check `req`'s tools against the model (`style`: its template's call syntax, None
    without tool support) and give it the call grammar: forced, or lazy under "auto"
    unless the request constrains the reply itself."""
    history = any(m.role == "tool" or m.tool_calls for m in req.messages)
    if (req.tools is not None or history) and style is None:
        raise ApiError(400, f"The model {model_id!r} has no tool support: its chat "
                            "template does not write tools in a call syntax Ember reads "
                            "(Hermes <tool_call> blocks as Qwen2.5's, Llama 3.1's JSON "
                            "or Mistral's [TOOL_CALLS])",
                       param="tools", code="tools_not_supported")
    if req.tools is None:
        return
    grammar = call_grammar(req.tools, lambda marker: token_ref(tokenizer, marker), style)
    if not req.tools.forced:  # calls well-formed once begun, unless the reply has a grammar
        if req.sampling.grammar is None and not req.ignore_eos:
            req.sampling = replace(req.sampling, grammar=grammar)
        return
    if req.sampling.grammar is not None or req.ignore_eos:
        other = req.constrained_by or "ignore_eos"
        raise ApiError(400, f"tool_choice {req.tools.choice!r} forces a call through a "
                            f"grammar: it cannot be combined with {other}",
                       param="tool_choice")
    req.sampling = replace(req.sampling, grammar=grammar)


def token_ref(tokenizer, marker: str) -> str | None:
    """How a grammar names `marker`'s token (llguidance's `<[id]>`); None if it has none."""
    token = tokenizer.id_of(marker)
    return None if token is None else f"<[{token}]>"


def bad_request(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _function_name(tool, where: str) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
            and set(tool) == {"type", "function"}
            and set(fn) <= {"name", "description", "parameters", "strict"}
            and isinstance(fn.get("name"), str) and _NAME.fullmatch(fn["name"])
            and isinstance(fn.get("description", ""), str)
            and isinstance(fn.get("parameters", {}), dict)):
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{name, "
                          "description?, parameters?}}}} with a name of letters, digits, _ "
                          "or - (up to 64)", where)
    return fn["name"]


def call_grammar(request: ToolRequest, token_ref: Callable[[str], str | None],
                 style: str = "hermes") -> Grammar:
    """A Lark grammar for the reply. Forced ("required" or a name): one call block to an
    allowed function. "auto": free text until the model opens a call block, then calls only
    (with `parallel` off, one), each an allowed function with arguments valid under its
    parameters; the text ends where a call begins (what `split_calls` reads as content).
    `token_ref(text)`: how the grammar names that marker's token (`<[id]>`), None when the
    vocabulary has none (then it is spelled, and the free text ends lazily at its first
    spelling); free text never contains a token the grammar names."""
    functions = [t["function"] for t in request.tools
                 if request.choice in ("auto", "required", t["function"]["name"])]
    if style != "hermes":  # Llama 3's or Mistral's syntax
        return Grammar("lark", syntax_grammar(style, functions, request.forced,
                                              request.parallel, token_ref, _JSON_STYLE))
    open_, close = (token_ref(m) or json.dumps(m) for m in (OPEN, CLOSE))
    rules = [f"call: {open_} body", f'body: "\\n" args "\\n" {close}',
             f"args: %json {call_schema(functions, 'arguments', _JSON_STYLE)}"]
    if request.forced:
        return Grammar("lark", "\n".join(["start: call", *rules]) + "\n")
    more = ' ("\\n" call)*' if request.parallel else ""
    if token_ref(OPEN):
        head = [f"start: TEXT | TEXT call{more}"]
    else:  # the free text and the marker after it as one lexeme, ended at the marker
        head = [f"start: TEXT | opening body{more}", f"opening[lazy]: TEXT {open_}"]
    return Grammar("lark", "\n".join(["%llguidance {}", *head, *rules,
                                      "TEXT: /(.|\\n)*/"]) + "\n")


def split_calls(text: str, names: set[str] = frozenset(),
                style: str = "hermes") -> tuple[str, list[dict]]:
    """The reply's text before its first call, and its calls as OpenAI `tool_calls`; a block
    whose JSON is not {"name", "arguments"} is left as text.

    Without call blocks, a reply that is nothing but such JSON (bare or in a ```json fence)
    naming one of `names` is a call too: Qwen2.5-Coder writes its calls that way, though its
    template asks for the tags. Another `style`: call_syntax.read_calls."""
    if style != "hermes":
        return read_calls(style, text, names)
    calls, first = [], None
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        first = m.start() if first is None else first
    if not calls:
        bare = _FENCE.fullmatch(text.strip())
        call = _call(bare.group(1)) if bare else None
        if call is not None and call["function"]["name"] in names:
            return "", [call]
        return text, []
    return text[:first].strip(), calls


_FENCE = re.compile(r"(?:```(?:json)?\s*)?(\{.*\})(?:\s*```)?", re.DOTALL)


def _call(block: str) -> dict | None:
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": call_id("hermes"), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments,
                                                                         ensure_ascii=False)}}
