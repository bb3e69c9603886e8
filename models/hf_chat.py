"""A Hugging Face folder's chat settings: its chat template and the ids that end a reply.

Folders keep these in several places, by age: `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates), a `chat_template.jinja` file beside it, and
`eos_token_id` in `generation_config.json` / `config.json` (a list where several tokens
end a reply, as Llama 3.1's end of text, end of message and end of turn).
"""

from __future__ import annotations

import json
from pathlib import Path


def hf_chat_template(folder: Path) -> str | None:
    """The folder's chat template: the "default" one of a named list; None without one."""
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    try:
        return (folder / "chat_template.jinja").read_text(encoding="utf-8") or None
    except (OSError, UnicodeDecodeError):  # a chat template is optional
        return None


def hf_stop_ids(folder: Path, n_tokens: int) -> tuple[int, ...]:
    """Every eos_token_id the folder's configs name (ids outside the vocabulary ignored)."""
    ids = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        ids += value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(i for i in ids
                               if isinstance(i, int) and not isinstance(i, bool)
                               and 0 <= i < n_tokens))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # absent or malformed: nothing to read
        return {}
    return data if isinstance(data, dict) else {}
