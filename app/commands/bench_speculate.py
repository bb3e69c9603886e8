"""`ember bench speculate`: plain decoding vs each drafter, same process, interleaved.

Three kinds of prompt: prose to continue, code to continue, and a text to repeat; or, with
--prompts-file, chat requests read from a JSON-lines file (each line's "request" sent as a
user message in the model's chat format, e.g. bench/data/humaneval10_chat.jsonl). Every run
is greedy with EOS ignored; each drafter's token ids are compared with plain decoding's
(speculation is lossless, so they must be equal). Tokens/s is over the tokens after the
first (prefill excluded); the accepted length counts accepted drafts plus the target's own
token per verification. With --runs N each prompt runs N times, engines interleaved, and
its figures are the medians; every prompt's speedup is reported, with the median and the
range over prompts of each kind.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ember.models.support.errors import EmberError

from ..progress import progress_bar
from .common import engine_options, model_path, print_json

_FOX = ("The old lighthouse stood at the end of the harbour wall. Every night its keeper "
        "climbed one hundred and twelve steps, trimmed the wick, wound the clockwork and "
        "watched the beam sweep across the black water until dawn.")

PROMPTS = {
    "prose": [
        "The history of the printing press begins in the fifteenth century, when",
        "She opened the letter slowly, already knowing what it would say. The",
        "Photosynthesis is the process by which green plants",
        "In the winter of 1848, the small village at the foot of the mountains",
        "The most important thing to understand about compound interest is that",
        "After the storm had passed, the fishermen returned to the harbour and",
        "A good night's sleep matters for memory because",
    ],
    "code": [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "import json\n\n\ndef load_config(path):\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
        "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
        "#include <stdio.h>\n\nint main(void) {\n",
        "function debounce(fn, ms) {\n  let timer;\n",
        "SELECT name, COUNT(*) AS orders\nFROM customers\n",
    ],
    "repeat": [
        f"Repeat the following text exactly.\n\nText: {_FOX}\n\nRepeated: The old lighthouse",
        "Copy this list:\n1. apples\n2. bread\n3. cheese\n4. dates\n5. eggs\n\nCopy:\n1. apples",
        f"{_FOX}\n\nOnce more, word for word:\n\nThe old",
        ("Please repeat: The meeting is moved to Thursday at three in the afternoon in room "
         "four, bring the quarterly figures and the draft budget.\nRepeat: The meeting"),
        ("def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n    return 2 * "
         "3.14159 * r\n\n# the same two functions again:\ndef area(r):\n"),
        ("Roses are red, violets are blue, sugar is sweet, and so are you.\n"
         "Say it again: Roses are red,"),
        ("Line: the cat sat on the mat and looked at the hat.\nLine: the cat sat on the mat and "
         "looked at the hat.\nLine:"),
    ],
}


def _options(args, speculate: str, tree: str | None):
    """The command's engine flags with one drafter (or none): every engine is built alike."""
    return engine_options(args, threads=args.threads or 2, speculate=speculate, tree=tree,
                          draft_model=args.draft_model if speculate == "model" else None)


def _run(engine, ids, gen: int) -> tuple[list[int], float, float, dict | None]:
    from ember.offload.options.sampling import GREEDY

    engine.forget("default")
    done = engine.generate(ids, sampling=GREEDY, max_tokens=gen, ignore_eos=True)
    spec = engine.speculation if engine.drafter is not None else None
    return done.token_ids, done.timings.decode_tokens_per_s, done.timings.ttft_s, spec


def run(args) -> int:
    if args.gen_tokens < 2 or (args.prompts or 1) < 1 or args.runs < 1:
        raise EmberError("--gen-tokens must be >= 2, --prompts and --runs >= 1")
    if "model" in args.drafters and not args.draft_model:
        raise EmberError("the 'model' drafter needs --draft-model PATH")
    if args.prompts_file:
        prompts = {"requests": read_requests(Path(args.prompts_file))[: args.prompts]}
    else:
        prompts = {k: v[: args.prompts or 2] for k, v in PROMPTS.items()}
    print_json(measure(args, prompts, chat=bool(args.prompts_file)))
    return 0


def read_requests(path: Path) -> list[str]:
    """The "request" of each line of a JSON-lines file (EmberError naming what is wrong)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        requests = [json.loads(line)["request"] for line in lines]
    except OSError as e:
        raise EmberError(f"--prompts-file {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise EmberError(f"--prompts-file {path}: each line must be a JSON object with a "
                         "\"request\" string") from None
    if not requests or not all(isinstance(r, str) and r for r in requests):
        raise EmberError(f"--prompts-file {path}: no requests, or one that is not a string")
    return requests


def measure(args, prompts: dict[str, list[str]], chat: bool = False) -> dict:
    """Plain vs every drafter on each prompt, interleaved; per-kind medians and ratios."""
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine

    loaded = load_model(model_path(args))
    engines = {"plain": Engine(loaded, _options(args, "off", None))}
    for name in args.drafters:
        engines[name] = Engine(loaded, _options(args, name, args.tree))
    import torch

    warm = engines["plain"].encode("warm up")
    for engine in engines.values():
        _run(engine, warm, 4)
    mismatches = []
    runs = [(kind, text) for kind, texts in prompts.items() for text in texts]
    with progress_bar("bench speculate", args.json, total=len(runs) * len(engines),
                      unit="runs") as bar:
        rows = {kind: {name: _Figures() for name in engines} for kind in prompts}
        for i, (kind, text) in enumerate(runs):
            ids = _encode(engines["plain"], text, chat)
            mismatches += _compare(engines, kind, text, ids, args, rows[kind])
            bar((i + 1) / len(runs), f"{kind} prompt, {len(engines)} engines")
    return {
        "model": str(model_path(args)), "threads": torch.get_num_threads(),
        "gen_tokens": args.gen_tokens, "runs": args.runs, "chat": chat,
        "prompts_per_kind": {k: len(v) for k, v in prompts.items()},
        "lm_head": engines["plain"].lm_head,
        "drafters": {n: e.drafter.name for n, e in engines.items() if e.drafter is not None},
        "trees": {n: list(e.tree_widths) for n, e in engines.items() if e.drafter is not None},
        "kinds": {kind: _summary(r) for kind, r in rows.items()},
        "identical_to_plain": not mismatches, "mismatches": mismatches,
    }


def _encode(engine, text: str, chat: bool):
    if not chat:
        return engine.encode(text)
    from ember.models.chat_format import ChatMessage

    return engine.encode_chat([ChatMessage("user", text)])


class _Figures:
    """One engine's figures on one kind of prompt: per prompt, medians over its runs."""

    def __init__(self):
        self.tok_s, self.ttft_s, self.accepted, self.share = [], [], [], []

    def add(self, runs: list[tuple[float, float, dict | None]]) -> None:
        self.tok_s.append(statistics.median(r[0] for r in runs))
        self.ttft_s.append(statistics.median(r[1] for r in runs))
        specs = [r[2] for r in runs if r[2]]
        if specs:
            self.accepted.append(statistics.mean(s["mean_accepted_length"] for s in specs))
            self.share.append(statistics.mean(s["drafter_time_share"] for s in specs))


def _compare(engines: dict, kind: str, text: str, ids, args, rows: dict) -> list[dict]:
    """Every engine on one prompt (`args.runs` rounds, engines interleaved in each), its
    figures added to `rows`; the drafters whose tokens differ from plain decoding's
    (speculation must be lossless)."""
    ref, mismatches = None, []
    results = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, engine in engines.items():
            out, tok_s, ttft, spec = _run(engine, ids, args.gen_tokens)
            ref = out if ref is None else ref
            if out != ref and not any(m["drafter"] == name for m in mismatches):
                mismatches.append({"kind": kind, "prompt": text, "drafter": name})
            results[name].append((tok_s, ttft, spec))
    for name, runs in results.items():
        rows[name].add(runs)
    return mismatches


def _summary(rows: dict) -> dict:
    plain = rows["plain"]
    out = {"plain_tok_s": statistics.median(plain.tok_s),
           "plain_ttft_s": statistics.median(plain.ttft_s)}
    for name, r in rows.items():
        if name == "plain":
            continue
        speedups = [a / b if b else 0.0 for a, b in zip(r.tok_s, plain.tok_s)]
        out[name] = {
            "tok_s": statistics.median(r.tok_s),
            "speedup": statistics.median(speedups),
            "speedup_min": min(speedups), "speedup_max": max(speedups),
            "speedup_per_prompt": [round(x, 3) for x in speedups],
            "ttft_s": statistics.median(r.ttft_s),
            "mean_accepted_length": statistics.mean(r.accepted) if r.accepted else 0.0,
            "drafter_time_share": statistics.mean(r.share) if r.share else 0.0,
        }
    return out
