"""`ember bench speculate`: plain decoding vs each drafter, same process, interleaved.

Three kinds of prompt: prose to continue, code to continue, and a text to repeat. Every run
is greedy with EOS ignored; each drafter's token ids are compared with plain decoding's
(speculation is lossless, so they must be equal). Tokens/s is over the tokens after the
first (prefill excluded); the accepted length counts accepted drafts plus the target's own
token per verification.
"""

from __future__ import annotations

import statistics

from ember.models.errors import EmberError

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


def _run(engine, ids: list[int], gen: int) -> tuple[list[int], float, dict | None]:
    from ember.offload.options.sampling import GREEDY

    engine.forget("default")
    done = engine.generate(ids, sampling=GREEDY, max_tokens=gen, ignore_eos=True)
    spec = engine.speculation if engine.drafter is not None else None
    return done.token_ids, done.timings.decode_tokens_per_s, spec


def run(args) -> int:
    if args.gen_tokens < 2 or args.prompts < 1:
        raise EmberError("--gen-tokens must be >= 2 and --prompts >= 1")
    if "model" in args.drafters and not args.draft_model:
        raise EmberError("the 'model' drafter needs --draft-model PATH")
    report = measure(args, {k: v[: args.prompts] for k, v in PROMPTS.items()})
    print_json(report)
    return 0


def measure(args, prompts: dict[str, list[str]]) -> dict:
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
        rows = {kind: {name: {"tok_s": [], "accepted": [], "share": []} for name in engines}
                for kind in prompts}
        for i, (kind, text) in enumerate(runs):
            mismatches += _compare(engines, kind, text, args.gen_tokens, rows[kind])
            bar((i + 1) / len(runs), f"{kind} prompt, {len(engines)} engines")
    kinds = {kind: _summary(r) for kind, r in rows.items()}
    return {
        "model": str(model_path(args)), "threads": torch.get_num_threads(),
        "gen_tokens": args.gen_tokens, "prompts_per_kind": {k: len(v) for k, v in prompts.items()},
        "lm_head": engines["plain"].lm_head,
        "trees": {n: list(e.tree_widths) for n, e in engines.items() if e.drafter is not None},
        "kinds": kinds,
        "identical_to_plain": not mismatches, "mismatches": mismatches,
    }


def _compare(engines: dict, kind: str, text: str, gen: int, rows: dict) -> list[dict]:
    """Every engine on one prompt, its figures added to `rows`; the drafters whose tokens
    differ from plain decoding's (speculation must be lossless)."""
    ids = engines["plain"].encode(text)
    ref, mismatches = None, []
    for name, engine in engines.items():
        out, tok_s, spec = _run(engine, ids, gen)
        ref = out if ref is None else ref
        if out != ref:
            mismatches.append({"kind": kind, "prompt": text, "drafter": name})
        rows[name]["tok_s"].append(tok_s)
        if spec:
            rows[name]["accepted"].append(spec["mean_accepted_length"])
            rows[name]["share"].append(spec["drafter_time_share"])
    return mismatches


def _summary(rows: dict) -> dict:
    plain = statistics.median(rows["plain"]["tok_s"])
    out = {"plain_tok_s": plain}
    for name, r in rows.items():
        if name == "plain":
            continue
        tok_s = statistics.median(r["tok_s"])
        out[name] = {
            "tok_s": tok_s,
            "speedup": tok_s / plain if plain else 0.0,
            "mean_accepted_length": statistics.mean(r["accepted"]) if r["accepted"] else 0.0,
            "drafter_time_share": statistics.mean(r["share"]) if r["share"] else 0.0,
        }
    return out
