"""`ember tokenize`: token ids of a text, BOS first."""

from __future__ import annotations

from .common import model_path, print_json


def run(args) -> int:
    from ember.models.loader import open_model

    tokenizer = open_model(model_path(args)).tokenizer
    ids = tokenizer.encode(args.text, add_bos=True, parse_special=args.special)
    if args.json:
        print_json({"ids": ids, "pieces": [tokenizer.token_text(i) for i in ids]})
    else:
        print(" ".join(map(str, ids)))
    return 0
