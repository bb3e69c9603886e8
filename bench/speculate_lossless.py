"""Lossless check of speculative decoding on the default model: for every prompt of
`ember bench speculate` (prose, code, repeat: 21 in all) and every drafter, greedy token ids
with speculation must equal plain decoding's, token for token.

    .venv/bin/python -m bench.speculate_lossless [--gen-tokens 48] [--drafters self lookup]

Prints one JSON object (the bench's report over all prompts; `identical_to_plain` is the
verdict) and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

from ember.app.commands.bench_speculate import PROMPTS, measure
from ember.app.commands.common import print_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--drafters", nargs="+", default=["self", "lookup"])
    p.add_argument("--draft-model")
    p.add_argument("--tree")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    args.model, args.device, args.ctx_size = None, "cpu", 2048
    report = measure(args, PROMPTS)
    print_json(report)
    return 0 if report["identical_to_plain"] else 1


if __name__ == "__main__":
    sys.exit(main())
