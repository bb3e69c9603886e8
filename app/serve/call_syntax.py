"""The call syntaxes of Llama 3.1+ and Mistral templates, beside Hermes (tools.py).

- "llama3": the whole reply is one call, `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>` (a control token: it leaves no text).
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; `[TOOL_CALLS]` is a
  control token in Mistral's vocabularies (no text), spelled in others. Mistral's templates
  take only 9-character alphanumeric call ids, so its calls get such ids.

Each has its grammar (llguidance Lark: free text, or calls to offered functions with
arguments valid under their schemas) and its reader (the reply's text back into calls).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Callable

PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
_KEY = {"llama3": "parameters", "mistral": "arguments"}
_ID_CHARS = string.ascii_letters + string.digits


def call_id(style: str) -> str:
    if style == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def call_schema(functions: list[dict], key: str, style: dict) -> str:
    """JSON schema text of one call: {"name": one of `functions`, key: its arguments}."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": fn["name"]},
                               key: fn.get("parameters") or {"type": "object"}}}
               for fn in functions]
    return json.dumps({"anyOf": options, "x-guidance": style})


def syntax_grammar(style: str, functions: list[dict], forced: bool, parallel: bool,
                   token_ref: Callable[[str], str | None], json_style: dict) -> str:
    """Lark text for a reply in `style` ("llama3" or "mistral"): forced, one call; else free
    text or calls (llama3: a reply opening with "{" is a call; mistral: calls after the
    marker, several unless `parallel` is off)."""
    call = f"call: %json {call_schema(functions, _KEY[style], json_style)}"
    if style == "llama3":
        tag = token_ref(PYTHON_TAG)
        tagged = f" | {tag} call" if tag else ""
        free = "" if forced else "TEXT? | "
        return "\n".join(["%llguidance {}", f"start: {free}call{tagged}", call,
                          "TEXT: /[^{](.|\\n)*/"]) + "\n"
    calls = 'calls: "[" call (", " call)* "]"' if parallel and not forced else \
        'calls: "[" call "]"'
    marker = token_ref(TOOL_CALLS)
    if forced:
        head = f'start: {marker or json.dumps(TOOL_CALLS)} " "? calls'
    elif marker:
        head = f'start: TEXT | TEXT {marker} " "? calls'
    else:  # spelled: the free text ends lazily at the marker
        head = f'start: TEXT | opening " "? calls\nopening[lazy]: TEXT {json.dumps(TOOL_CALLS)}'
    return "\n".join(["%llguidance {}", head, calls, call, "TEXT: /(.|\\n)*/"]) + "\n"


def read_calls(style: str, text: str, names: set[str]) -> tuple[str, list[dict]]:
    """(content, calls) of a reply in `style`; no calls unless every one parses and names
    an offered function."""
    if style == "llama3":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        found = _objects(body, style, names) if body.startswith("{") else None
        return ("", found) if found else (text, [])
    at = text.find(TOOL_CALLS)
    start = at + len(TOOL_CALLS) if at >= 0 else _list_start(text)
    if start is None or start < 0:
        return text, []
    found = _objects(text[start:].strip(), style, names)
    if not found:
        return text, []
    return text[:at if at >= 0 else start].strip(), found


def _list_start(text: str) -> int | None:
    """Where a call list begins when the marker left no text: the first `[{"name"`."""
    m = re.search(r'\[\s*\{\s*"name"', text)
    return m.start() if m else None


def _objects(body: str, style: str, names: set[str]) -> list[dict] | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names):
            return None
        arguments = item.get(_KEY[style], item.get("arguments", item.get("parameters", {})))
        calls.append({"id": call_id(style),
                      "type": "function",
                      "function": {"name": item["name"],
                                   "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls or None
