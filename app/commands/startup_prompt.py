"""What `ember bench startup` needs to know of a model before it times anything: a prompt
text that tokenizes to exactly N ids (BOS included), its ids, the file's size and the KV
cache an engine plans for the context.

It runs in a child process (`python -m ember.app.commands.startup_prompt MODEL N CTX`,
printing one JSON object), not in the bench itself: the kernel counts a child's peak RSS from
the high-water mark its parent had when it was spawned, so the bench process must stay small
and never load a model or torch itself.
"""

from __future__ import annotations

import json
import os
import sys

from ember.models.support.errors import EmberError

from .bench_decode import PROSE_TEXT


def prompt_of_length(encode, n: int, text: str = PROSE_TEXT) -> str:
    """The shortest prefix of `text` ending a word (or else, where one word adds several
    tokens at once, any character) that `encode` (text -> ids with BOS) turns into exactly
    `n` ids."""
    ends = [i for i, c in enumerate(text) if c == " "] + [len(text)]
    for cuts in (ends, range(1, len(text) + 1)):
        for end in cuts:
            got = len(encode(text[:end]))
            if got == n:
                return text[:end]
            if got > n:
                break
    raise EmberError(f"no prefix of the benchmark text tokenizes to {n} tokens with this "
                     "model's tokenizer")


def prepare(path: str, n_tokens: int, n_ctx: int) -> dict:
    from ember.models.loader import open_model
    from ember.offload.kv.plan import plan_kv
    from ember.offload.body.file_blocks_model import kv_dtype

    source = open_model(path)
    cfg, tokenizer = source.config, source.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=True)

    prompt = prompt_of_length(encode, n_tokens)
    ctx = min(n_ctx, cfg.context_length)
    kv = plan_kv(cfg, ctx, value_bytes=kv_dtype().itemsize)  # what `generate` on the CPU holds
    return {"prompt": prompt, "prompt_ids": encode(prompt), "n_ctx": ctx,
            "file_bytes": os.path.getsize(path), "name": cfg.name,
            "architecture": cfg.architecture,
            # One full context of K and V: the device pool an engine allocates.
            "kv_cache_bytes": kv.min_device_blocks * kv.block_bytes}


def main(argv: list[str]) -> int:
    path, n_tokens, n_ctx = argv[0], int(argv[1]), int(argv[2])
    try:
        print(json.dumps(prepare(path, n_tokens, n_ctx)))
    except EmberError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
