"""Calibration tokens without a dataset: the model continues varied seed prompts.

Kept a pure function of `generate(ids, n) -> new ids` and `encode(text) -> ids`, so any
sampler (the engine, a test stub) can supply the text. Whole continuations go to either the
training or the held-out side, never both, so held-out scores are not inflated by overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ember.models.support.errors import ConfigError

SEED_PROMPTS: tuple[str, ...] = (
    "The lighthouse keeper had not seen a ship in eleven days when the fog finally lifted and",
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] pairs.\"\"\"\n",
    "How to repot a houseplant, step by step:\n1.",
    "Customer: My order arrived with a cracked lid. What can I do?\nAgent:",
    "The mitochondrion is an organelle found in most eukaryotic cells. Its main role",
    "Shopping list for a week of simple dinners:\n-",
    "SELECT customers.name, COUNT(orders.id) AS n_orders\nFROM customers\n",
    "Dear neighbours, the annual street cleanup will take place next Saturday, and",
    "Q: Why does ice float on water?\nA:",
    "In 1869 the first transcontinental railroad in the United States was completed, which",
    "She opened the old notebook and found, pressed between two pages, a ticket that",
    "Instructions: Summarize the paragraph below in two sentences.\nParagraph: Rivers carry",
    "#include <stdio.h>\n\nint main(void) {\n    int counts[26] = {0};\n",
    "Top five tips for a first marathon:\n1.",
    "Alice: Did you finish the slides for tomorrow?\nBob: Almost, I still need",
    "A prime number is a natural number greater than 1 that",
    "The recipe calls for two cups of flour, a pinch of salt and",
    "Chapter 3\n\nThe train slowed as it climbed into the mountains, and Mara pressed her face",
    "To configure the server, edit the file config.yaml and set",
    "Photosynthesis converts light energy into chemical energy. During the light reactions,",
    "Translate to French: \"Where is the nearest train station?\"\nFrench:",
    "The committee reviewed three proposals for the new library. The first proposal",
)


@dataclass
class CalibrationText:
    train: list[int]
    held_out: list[int]


def split_ids(ids: Sequence[int], held_out: float = 0.2) -> CalibrationText:
    """Split one token sequence: the last `held_out` fraction is held out."""
    if not 0 < held_out < 1:
        raise ConfigError(f"held_out must be between 0 and 1, got {held_out}")
    cut = round(len(ids) * (1 - held_out))
    return CalibrationText(list(ids[:cut]), list(ids[cut:]))


def sampled_text(generate: Callable[[list[int], int], list[int]],
                 encode: Callable[[str], list[int]], tokens: int, held_out: float = 0.2,
                 prompts: Sequence[str] = SEED_PROMPTS) -> CalibrationText:
    """About `tokens` calibration tokens: each prompt continued by `generate`.

    Args:
        generate: (prompt ids, n) -> n (or fewer, at end of text) new token ids.
        encode: text -> ids, without BOS.
        held_out: fraction of prompts whose text goes to the held-out side.
    """
    if len(prompts) < 2:
        raise ConfigError("give at least two prompts: one for training, one held out")
    if not 0 < held_out < 1:
        raise ConfigError(f"held_out must be between 0 and 1, got {held_out}")
    n_held = min(len(prompts) - 1, max(1, round(len(prompts) * held_out)))
    per_prompt = max(1, tokens // len(prompts))
    # Held-out prompts are spread through the list, so both sides mix the genres.
    step = len(prompts) / n_held
    held = {int((j + 0.5) * step) for j in range(n_held)}
    out = CalibrationText([], [])
    for i, prompt in enumerate(prompts):
        ids = list(encode(prompt))
        (out.held_out if i in held else out.train).extend(ids + list(generate(ids, per_prompt)))
    return out
