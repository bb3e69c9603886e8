"""`ember models`: the GGUF models on this machine (Ember's own directory and the Hugging
Face, Ollama and LM Studio stores, read in place), what each is, and the name `--model`
takes for it; the ones Ember cannot run, with the reason; the catalog's not yet pulled."""

from __future__ import annotations

from ember.models.catalog import CATALOG, installed_path, target_path
from ember.models.model_list import ModelListing, list_models
from ember.models.support.sizes import format_size

from .common import print_json

COLUMNS = ("NAME", "ARCH", "PARAMS", "SIZE", "QUANT", "CHAT", "FROM")


def run(args) -> int:
    listings = list_models()
    present = {str(target_path(m)) for m in CATALOG if installed_path(m) is not None}
    to_pull = [m for m in CATALOG if m.packages and str(target_path(m)) not in present]
    if args.json:
        print_json({"models": [m.to_dict() for m in listings],
                    "to_pull": [{"name": m.name, "title": m.title, "size_bytes": m.size}
                                for m in to_pull]})
        return 0
    runnable = [m for m in listings if m.runnable]
    if runnable:
        _table([_row(m) for m in runnable])
    else:
        print("No models found yet besides the default (it is assembled on first use).")
    for m in runnable:
        if m.note:
            print(f"  {m.name}: {m.note}")
    others = [m for m in listings if not m.runnable]
    if others:
        print("\nFound, but Ember cannot run them:")
        for m in others:
            print(f"  {m.name}  ({m.store}, {m.path})\n      {m.problem}")
    if to_pull:
        print("\nIn Ember's catalog, not downloaded yet:")
        for m in to_pull:
            print(f"  ember pull {m.name:<32} {m.title}, {format_size(m.size)}")
    return 0


def _row(m: ModelListing) -> tuple[str, ...]:
    params = f"{m.parameters / 1e9:.2f}B" if m.parameters else "?"
    return (m.name, m.architecture or "?", params, format_size(m.size_bytes), m.quant or "?",
            m.chat_format or "?", m.store)


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    for row in [COLUMNS, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
