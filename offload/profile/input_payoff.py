"""Which thresholded matmul slots pay on this machine, timed while decoding.

Input thresholds skip the weight columns of dropped inputs, but bytes skipped are not time
saved: the memory reads a random subset of short runs (an input's column is N/2 bytes of a
4-bit weight, 1-3 KiB on 1B-7B models) little faster than all of them (bench/memory_skip.py
measures that ceiling), and the input-sparse kernel does more work per weight than the dense
one on the file's blocks. So `ember profile` times greedy decoding of the model it calibrated:
dense, then each slot kind ("qkv", "o", "gate_up", "down") thresholded alone over every layer,
interleaved over several rounds and compared by their best round (a busy spell on a shared
machine slows some rounds of each, and two processes that each want every core can make one
round many times slower), then the paying ones together. A slot pays when its decode is faster than dense by `MARGIN`; the
set pays only if together they are faster too. The artifact records the list ("input_pays");
an engine with `--ffn-mode auto` applies only those slots, `--ffn-mode sparse` all of them.
"""

from __future__ import annotations

import time

import torch

from ..body.input_sparsity import SLOTS, Thresholds

MARGIN = 0.02  # a slot must beat dense by 2%: within noise it is not worth its quality loss
TOKENS = 16
ROUNDS = 3


def decode_seconds(model, prompt: list[int], n: int, runtime=None) -> float:
    """Seconds per greedy token of `model` (a FileBlocksModel) over `n` tokens after a prefill of
    `prompt`; `runtime`'s counters (an InputSparsity) cover the decode only."""
    cache = model.new_cache(len(prompt) + n + 1)
    hidden = model.hidden(torch.tensor(prompt), cache)
    token = int(model.logits(hidden[-1:]).argmax())
    if runtime is not None:
        runtime.reset_counters()
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(model.logits(model.hidden(torch.tensor([token]), cache)).argmax())
    return (time.perf_counter() - t0) / n


def only(thresholds: Thresholds, slots) -> Thresholds:
    """The thresholds of `slots` only (every layer; the other slots run dense)."""
    keep = set(slots)
    return [{s: v for s, v in layer.items() if s in keep} for layer in thresholds]


def decide(seconds: dict[str, list[float]], margin: float = MARGIN) -> list[str]:
    """The slots whose best seconds per token beat dense's best by `margin`, in SLOTS order."""
    dense = min(seconds["dense"])
    return [s for s in SLOTS if s in seconds and min(seconds[s]) < dense * (1 - margin)]


def measure_payoff(model, runtime, thresholds: Thresholds, prompt: list[int],
                   tokens: int = TOKENS, rounds: int = ROUNDS, log=None) -> dict:
    """Time dense against each thresholded slot, then the paying ones together; leaves
    `runtime` (the model's InputSparsity) with no thresholds set. -> the report, whose "pays"
    lists the slots the engine should threshold by default."""
    present = [s for s in SLOTS if any(s in layer for layer in thresholds)]
    none: Thresholds = [{} for _ in thresholds]

    def timed(sets: dict[str, Thresholds]) -> dict[str, list[float]]:
        """Seconds per token of each threshold set, the sets interleaved round by round."""
        seconds: dict[str, list[float]] = {name: [] for name in sets}
        for _ in range(rounds):
            for name, chosen in sets.items():
                runtime.set_thresholds(chosen)
                seconds[name].append(decode_seconds(model, prompt, tokens, runtime))
        return seconds

    seconds = timed({"dense": none} | {s: only(thresholds, [s]) for s in present})
    pays = decide(seconds)
    together = None
    if len(pays) > 1:  # each paying alone need not pay together: check the set
        both = timed({"dense": none, "together": only(thresholds, pays)})
        together = 1 / min(both["together"])
        if min(both["together"]) >= min(both["dense"]) * (1 - MARGIN):
            pays = []
    runtime.set_thresholds(none)
    dense_s = min(seconds["dense"])
    report = {"tokens": tokens, "rounds": rounds, "margin": MARGIN,
              "dense_tok_s": round(1 / dense_s, 2),
              "slots": {s: {"tok_s": round(1 / min(seconds[s]), 2),
                            "speedup": round(dense_s / min(seconds[s]), 3)}
                        for s in present},
              "together_tok_s": None if together is None else round(together, 2),
              "pays": pays}
    if log is not None:
        log(f"decode {report['dense_tok_s']} tok/s dense; thresholded alone: " + ", ".join(
            f"{s} {v['tok_s']} ({v['speedup']:.2f}x)" for s, v in report["slots"].items())
            + f"; pays: {', '.join(pays) or 'none'}")
    return report
