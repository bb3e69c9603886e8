"""The llama.cpp side of `ember bench startup`: a fresh process that loads the model with
llama-cpp-python and greedily generates from the given token ids, then writes its times since
process start (first token, last token) to the file named by `EMBER_REPORT_TIMINGS`.

    python -m ember.app.baseline_startup MODEL --ctx-size N --threads T --max-tokens N --ids 1,2,3

It imports only llama_cpp, numpy (which llama_cpp imports anyway) and the standard-library
clock: nothing of Ember, so its start-up and memory are llama.cpp's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from .process_clock import TimingsReport


def generate(path: str, n_ctx: int, threads: int, ids: list[int], max_tokens: int) -> Iterator[int]:
    """Greedy, EOS ignored (as `ember generate --temperature 0 --ignore-eos`)."""
    import numpy as np
    from llama_cpp import Llama, llama_get_logits_ith

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                n_batch=512, verbose=False)

    def next_token() -> int:
        logits = llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))

    llm.eval(ids)
    tokens = [next_token()]
    yield tokens[0]
    for _ in range(max_tokens - 1):
        llm.eval([tokens[-1]])
        tokens.append(next_token())
        yield tokens[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.app.baseline_startup")
    p.add_argument("model")
    p.add_argument("--ctx-size", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--ids", required=True, help="prompt token ids, comma-separated, BOS first")
    args = p.parse_args(argv)
    report = TimingsReport.from_env()
    ids = [int(x) for x in args.ids.split(",")]
    tokens = []
    for token in generate(args.model, args.ctx_size, args.threads, ids, args.max_tokens):
        if report:
            report.mark("first_token")
        tokens.append(token)
    if report:
        report.write(generated_tokens=len(tokens), prompt_tokens=len(ids), token_ids=tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
