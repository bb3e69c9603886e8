"""What an agent asks of `ember serve`, through the official `openai` client, on a live server.

    .venv/bin/python -m bench.serve_agents --model ~/.cache/ember/real-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

Starts `ember serve` on a free port, then, streamed and not: ten extraction prompts with a
`json_schema` response format (every reply must parse and validate, jsonschema), ten tool-use
prompts with `tools` and tool_choice auto (a call to the right function whose arguments
validate counts), and a follow-up turn that returns a tool's result (the answer must use it).
Greedy throughout. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request

import jsonschema
from openai import OpenAI


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
EXTRACTIONS = [
    ("Alice Smith, 34, works as a nurse in Leeds.", _obj({"name": S, "age": I, "job": S, "city": S})),
    ("Order #4521: 3 lamps at 19.99 each, shipped to Oslo.",
     _obj({"order_id": I, "item": S, "quantity": I, "unit_price": N, "destination": S})),
    ("The meeting is on 2024-05-17 at 14:30 in room B2 with Tom and Ana.",
     _obj({"date": S, "time": S, "room": S, "people": {"type": "array", "items": S}})),
    ("Paris is the capital of France, population about 2.1 million.",
     _obj({"city": S, "country": S, "population_millions": N})),
    ("Review: 'Great battery, weak camera.' 4 out of 5 stars.",
     _obj({"pros": {"type": "array", "items": S}, "cons": {"type": "array", "items": S},
           "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("Flight BA117 leaves London Heathrow at 10:05 and lands in New York JFK at 13:00.",
     _obj({"flight": S, "from": S, "to": S, "departs": S, "arrives": S})),
    ("Recipe: mix 200 g flour, 2 eggs and 300 ml milk; rest 30 minutes.",
     _obj({"ingredients": {"type": "array", "items": _obj({"name": S, "amount": S})},
           "rest_minutes": I})),
    ("Bug: app crashes on login when the password has a space. Severity high. Android 14.",
     _obj({"summary": S, "severity": {"enum": ["low", "medium", "high"]}, "platform": S})),
    ("Invoice from Acme Ltd, total 1,250.00 EUR, due 30 June 2024, VAT 21%.",
     _obj({"vendor": S, "total": N, "currency": S, "due": S, "vat_percent": N})),
    ("Python 3.12 was released in October 2023 and adds better error messages.",
     _obj({"product": S, "version": S, "released": S, "features": {"type": "array", "items": S}})),
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": _obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": _obj({"amount": N, "from_currency": S, "to_currency": S})}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
     "parameters": _obj({"query": S})}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email",
     "parameters": _obj({"to": S, "subject": S, "body": S})}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
     "parameters": _obj({"timezone": S})}},
]
TOOL_PROMPTS = [
    ("What's the weather like in Berlin right now?", "get_weather"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Search the web for the latest Rust release notes.", "search_web"),
    ("Email bob@example.com with subject 'Lunch' saying I'm running late.", "send_email"),
    ("What time is it in Tokyo?", "get_time"),
    ("Is it raining in Lisbon? Use celsius.", "get_weather"),
    ("Convert 99.5 GBP to JPY.", "convert_currency"),
    ("Look up who won the 2022 World Cup.", "search_web"),
    ("What's the current time in America/New_York?", "get_time"),
    ("Send alice@example.com an email titled 'Report' with body 'Attached is the Q3 report.'",
     "send_email"),
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "ember.app.cli", "serve", "--model", model,
                             "--port", str(port), "--log-level", "warning", *extra])
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("ember serve exited")
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("ember serve did not start")


def _chat(client, model, stream: bool, **kw):
    """(content, tool_calls as [{name, arguments}], finish_reason) of one request."""
    if not stream:
        choice = client.chat.completions.create(model=model, temperature=0, **kw).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, temperature=0, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def extraction(client, model, stream: bool) -> dict:
    valid, failures, tokens = 0, [], 0
    for text, schema in EXTRACTIONS:
        content, _, _ = _chat(client, model, stream, max_tokens=200,
                              messages=[{"role": "user", "content": f"Extract the facts as JSON:\n{text}"}],
                              response_format={"type": "json_schema", "json_schema": {
                                  "name": "facts", "schema": schema, "strict": True}})
        try:
            jsonschema.validate(json.loads(content), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"text": text, "reply": content, "error": str(exc)[:200]})
    return {"prompts": len(EXTRACTIONS), "valid": valid, "failures": failures}


def tool_use(client, model, stream: bool) -> dict:
    valid, replies = 0, []
    for prompt, want in TOOL_PROMPTS:
        content, calls, finish = _chat(client, model, stream, max_tokens=120, tools=TOOLS,
                                       messages=[{"role": "user", "content": prompt}])
        ok = False
        for call in calls:
            try:
                if call["name"] == want:
                    jsonschema.validate(json.loads(call["arguments"]), PARAMS[want])
                    ok = True
            except (ValueError, jsonschema.ValidationError):
                pass
        valid += ok
        replies.append({"prompt": prompt, "want": want, "calls": calls, "finish": finish,
                        "content": content[:200], "valid": ok})
    return {"prompts": len(TOOL_PROMPTS), "valid": valid, "replies": replies}


def follow_up(client, model, stream: bool) -> dict:
    """A tool turn: the model calls get_weather, gets '17 °C, light rain', and answers; with
    the tools offered again (tool_choice auto), and with tool_choice none."""
    messages = [{"role": "user", "content": "What's the weather like in Berlin right now?"}]
    _, calls, _ = _chat(client, model, stream, max_tokens=120, tools=TOOLS, messages=messages,
                        tool_choice="required")
    if not calls:
        return {"answered": False, "reason": "no call"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": calls[0]}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 17, "sky": "light rain"}'}]
    out = {"call": calls[0]}
    for choice in ("auto", "none"):
        answer, again, _ = _chat(client, model, stream, max_tokens=80, tools=TOOLS,
                                 tool_choice=choice, messages=messages)
        out[choice] = {"answered": "17" in answer and "rain" in answer.lower(),
                       "answer": answer, "called_again": again}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--serve-args", default="", help="more `ember serve` flags, one string")
    parser.add_argument("--parts", nargs="+", default=["json_schema", "tools", "follow_up"],
                        choices=["json_schema", "tools", "follow_up"])
    args = parser.parse_args()
    port = _free_port()
    proc = _start(args.model, port, args.serve_args.split())
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        out = {"model": model}
        start = time.perf_counter()
        for stream in (False, True):
            key = "streamed" if stream else "whole"
            parts = {"json_schema": extraction, "tools": tool_use, "follow_up": follow_up}
            out[key] = {name: parts[name](client, model, stream) for name in args.parts}
        out["seconds"] = time.perf_counter() - start
        print(json.dumps(out, indent=1, ensure_ascii=False))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
