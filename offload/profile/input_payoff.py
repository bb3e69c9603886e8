"""Which thresholded matmul slots pay on this machine, timed while decoding.

Input thresholds skip the weight columns of dropped inputs, but bytes skipped are not time
saved: the memory reads a random subset of short runs (an input's column is N/2 bytes of a
4-bit weight, 1-3 KiB on 1B-7B models) little faster than all of them (bench/memory_skip.py
measures that ceiling), and the input-sparse kernel does more work per weight than the dense
one on the file's blocks. So `ember profile` times greedy decoding of the model it calibrated:
dense, then each slot kind ("qkv", "o", "gate_up", "down") thresholded alone over every layer,
interleaved over several rounds and compared by their best round (a busy spell on a shared
machine slows some rounds of each, and two processes that each want every core can make one
round many times slower), then the paying ones together. A slot pays when its decode is
faster than dense by `MARGIN`; the set pays only if together they are faster too. The artifact records the list ("input_pays");
an engine with `--ffn-mode auto` applies only those slots, `--ffn-mode sparse` all of them.

Only what can pay is timed. A slot's decode can beat dense by no more than the share of a
token's weight bytes its thresholds skip (decoding reads every weight once a token), nor by
more than its matmuls save. So first both bounds: the bytes from the calibration sample, and
each kind's matmuls alone timed, dense (the file's blocks) against thresholded (its tiles),
one row per call as decoding runs them, over every layer at its threshold (milliseconds). A
kind under `MARGIN` by either cannot pay and its decode is not timed. The bytes bound is also
immune to a busy machine, where a matmul can look 5% faster by chance. On the default model
at its 3% budget no kind skips 2% of a token's bytes (the LM head is 72% of them), so
the stage costs a few dense decodes instead of one per slot kind.
"""

from __future__ import annotations

import time

import torch

from ember.kernels import block_matmul as bm
from ember.kernels import input_sparse as isp

from ..body.input_sparsity import SLOTS, Thresholds, slot_weights

MARGIN = 0.02  # a slot must beat dense by 2%: within noise it is not worth its quality loss
TOKENS = 16
ROUNDS = 3
SAMPLE_ROWS = 4  # calibration rows per layer whose matmuls are timed, each as one call


def decode_seconds(model, prompt: list[int], n: int, runtime=None) -> float:
    """Seconds per greedy token of `model` (a QuantModel) over `n` tokens after a prefill of
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


def bytes_skipped(model, thresholds: Thresholds, stats) -> dict[str, float]:
    """Per thresholded slot kind: the share of a dense token's weight bytes its thresholds
    skip (each layer's slot bytes times the share of its calibration sample at or under its
    threshold): the most its decode can gain, were skipping bytes free."""
    total = model.weight_bytes_per_token()
    out: dict[str, float] = {}
    for i, layer in enumerate(model.layers):
        for slot, threshold in thresholds[i].items():
            dropped = float((stats[(i, slot)].sample <= threshold).float().mean())
            nbytes = sum(w.nbytes for w in slot_weights(layer, slot))
            out[slot] = out.get(slot, 0.0) + nbytes * dropped / total
    return out


def matmul_savings(model, runtime, thresholds: Thresholds, stats, rounds: int = ROUNDS,
                   rows: int = SAMPLE_ROWS) -> dict[str, float]:
    """Per thresholded slot kind: seconds per token its matmuls save, over every layer (the
    file's blocks less the tiles at the layer's threshold, one row per call, on `rows` rows of
    each layer's calibration sample `stats[(layer, slot)]`; best of `rounds` interleaved)."""
    out = {}
    for slot in SLOTS:
        work = [(slot_weights(layer, slot), runtime.tiles(i, slot), thresholds[i][slot],
                 stats[(i, slot)].sample[:rows].float())
                for i, layer in enumerate(model.layers) if slot in thresholds[i]]
        if not work:
            continue
        dense, sparse = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for weights, _, _, x in work:
                for r in range(x.shape[0]):
                    bm.block_matmul(x[r: r + 1], weights)
            t1 = time.perf_counter()
            for _, tiles, threshold, x in work:
                for r in range(x.shape[0]):
                    isp.input_sparse_matmul(x[r: r + 1], tiles, threshold)
            dense.append(t1 - t0)
            sparse.append(time.perf_counter() - t1)
        out[slot] = (min(dense) - min(sparse)) / max(1, min(x.shape[0] for *_, x in work))
    return out


def measure_payoff(model, runtime, thresholds: Thresholds, prompt: list[int], stats,
                   tokens: int = TOKENS, rounds: int = ROUNDS, log=None) -> dict:
    """Time dense decoding, each thresholded slot kind's matmuls, the decode of each kind
    whose matmuls could pay, then the paying ones together; leaves `runtime` (the model's
    InputSparsity) with no thresholds set. `stats`: the calibration's SlotStats, whose rows
    the matmuls are timed on. -> the report, whose "pays" lists the slots the engine should
    threshold by default."""
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

    runtime.set_thresholds(none)
    ideal = bytes_skipped(model, thresholds, stats)
    saved = matmul_savings(model, runtime, thresholds, stats, rounds)
    seconds = timed({"dense": none})
    candidates = [s for s in present
                  if ideal[s] > MARGIN and saved[s] > MARGIN * min(seconds["dense"])]
    if candidates:  # timed again beside them, so that dense shares their rounds
        seconds = timed({"dense": none} | {s: only(thresholds, [s]) for s in candidates})
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
              "slots": {s: {"bytes_skipped": round(ideal[s], 4),
                            "matmul_saving": round(saved[s] / dense_s, 4),
                            "timed": s in seconds,
                            "tok_s": round(1 / min(seconds[s]), 2) if s in seconds else None,
                            "speedup": (round(dense_s / min(seconds[s]), 3) if s in seconds
                                        else None)}
                        for s in present},
              "together_tok_s": None if together is None else round(together, 2),
              "pays": pays}
    if log is not None:
        log(f"decode {report['dense_tok_s']} tok/s dense; " + "; ".join(
            f"{s}: skips {v['bytes_skipped']:.1%} of a token's bytes, its matmuls save "
            f"{v['matmul_saving']:.1%} of its time"
            + (f", decode {v['tok_s']} tok/s ({v['speedup']:.2f}x)" if v["timed"] else
               f" (under {MARGIN:.0%}: not timed)")
            for s, v in report["slots"].items()) + f"; pays: {', '.join(pays) or 'none'}")
    return report
