"""What constrained decoding costs: decode tok/s with a JSON schema's mask against without.

    flock /tmp/ember-timing.lock .venv/bin/python -m bench.constrained_speed --model PATH [--runs 3]

Each run generates greedily from the same chat prompt twice, interleaved: under a JSON schema
(the mask computed and applied every step), then unconstrained for the same number of tokens
(ignore_eos, so both decode as long). Decode tok/s is the engine's own (after the first token).
Prints one JSON object with per-run figures and the median ratio constrained / plain, and
the time spent computing and applying the mask per token (thread CPU time, which a busy
machine disturbs far less than wall-clock tok/s): that over a plain step's time is the cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ember.models.chat_format import ChatMessage
from ember.offload.options.engine_options import EngineOptions
from ember.offload.options.sampling import Grammar, SamplingParams
from ember.offload.decode import grammar as grammar_module
from ember.offload.runtime.engine import Engine


class MaskClock:
    """Wraps GrammarConstraint.apply to add up its thread CPU time and calls."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        inner = grammar_module.GrammarConstraint.apply

        def timed(constraint, logits, generated):
            t0 = time.thread_time()
            inner(constraint, logits, generated)
            self.seconds += time.thread_time() - t0
            self.calls += 1

        grammar_module.GrammarConstraint.apply = timed

PROMPT = ("List twelve European cities with their country and a one-line note on each, "
          "as JSON.")
SCHEMA = {"type": "object", "required": ["cities"], "additionalProperties": False,
          "properties": {"cities": {"type": "array", "minItems": 12, "maxItems": 12, "items": {
              "type": "object", "required": ["city", "country", "note"],
              "additionalProperties": False,
              "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                             "note": {"type": "string"}}}}}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    engine = Engine.load(args.model, EngineOptions(threads=args.threads))
    ids = engine.encode_chat([ChatMessage("user", PROMPT)])
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    engine.check_sampling(SamplingParams(grammar=grammar))  # compiled once, outside the timing
    runs, clock = [], MaskClock()
    for _ in range(args.runs):
        engine.forget("default")  # each run prefills afresh
        clock.seconds = clock.calls = 0
        constrained = engine.generate(ids, sampling=SamplingParams(temperature=0, grammar=grammar),
                                      max_tokens=args.max_tokens)
        engine.forget("default")
        plain = engine.generate(ids, sampling=SamplingParams(temperature=0), ignore_eos=True,
                                max_tokens=len(constrained.token_ids))
        plain_tok_s = plain.timings.decode_tokens_per_s
        runs.append({"tokens": len(constrained.token_ids),
                     "constrained_tok_s": constrained.timings.decode_tokens_per_s,
                     "plain_tok_s": plain_tok_s,
                     "mask_ms_per_token": 1000 * clock.seconds / max(clock.calls, 1),
                     "mask_share_of_plain_step": (clock.seconds / max(clock.calls, 1))
                     * plain_tok_s if plain_tok_s else None})
    ratios = [r["constrained_tok_s"] / r["plain_tok_s"] for r in runs if r["plain_tok_s"]]
    print(json.dumps({"model": str(args.model), "runs": runs,
                      "median_ratio": statistics.median(ratios) if ratios else None,
                      "median_mask_share": statistics.median(
                          r["mask_share_of_plain_step"] for r in runs
                          if r["mask_share_of_plain_step"] is not None),
                      "constrained_text": constrained.text}, indent=1))


if __name__ == "__main__":
    main()
