"""Calibrating input thresholds (`ember profile` on GLU models): activation statistics ->
allocation across every layer's four matmul slots -> the highest sparsity within the quality
budget on calibration text set aside.

1. Statistics: a reference pass over the calibration text records a sample of every slot's
   input rows (offload/body/input_sparsity.py names the slots), and each slot's squared column
   norms ||W[:, i]||^2 (over its weights side by side).
2. Allocation: per slot, the threshold for sparsity s is the s-quantile of |x| over the
   sample; its proxy error is the share of the matmul's output energy the dropped inputs
   carry, sum_dropped x_i^2 ||W[:, i]||^2 / sum_all x_i^2 ||W[:, i]||^2 (columns taken as
   uncorrelated; the column norm is WINA's weighting). The drop criterion itself stays |x|:
   WINA's |x_i| * ||W[:, i]|| was measured worse on the default model (every layer's slot of
   one kind thresholded, held-out perplexity ratio at 50%: q/k/v x1.369 vs x1.330, o x1.162
   vs x1.106, down x1.041 vs x1.020, gate/up equal), so no per-input scale is needed at
   run time. Three allocations (ALLOCATIONS):
   "global" (the default; input_allocation.py) scales each slot's proxy by its measured
   end-to-end KL and raises, across the whole body, the cheapest slot next; "block" raises,
   per block, the slot of cheapest proxy error per matmul sparsity gained in steps of 5% until
   the block's mean over its seven matmuls (q, k, v, o, gate, up, down) reaches the target;
   "uniform" puts every slot at the target.
3. Search: the target is bisected on the perplexity of calibration text set aside for it
   (`carve`: runs spread over the text, which the statistics and KL probes never see),
   measured with the thresholds applied by the runtime itself (the input-major kernels),
   against the same model dense: the highest target within `budget` wins. The curve it
   walked (target -> realized sparsity, perplexity ratio, top-1 agreement) is on that text;
   the held-out text is read only by the final check (input_profile.py), which so measures
   thresholds it did not help pick. (Scoring the held-out text at every step as well, for
   the curve alone, cost as much as the search itself.)
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from ember.kernels import block_matmul as bm
from ember.models.support.errors import ConfigError
from ember.kernels.decoder_step import decoder_step_reference
from ember.predictors.passes import score, segments

from .input_allocation import (KL_TOKENS, PROBE_EVERY, PROBES, allocate_global, dense_reference, kl_from_layer,
                               slot_costs)
from .layer_chain import LayerChain
from .profile_options import Stage
from ..body.input_sparsity import MATMULS, SLOTS, InputSparsity, Thresholds, apply_input_sparsity, slot_weights

STEP = 0.05
LEVELS = tuple(round(i * STEP, 2) for i in range(int(round(0.95 / STEP)) + 1))  # 0 .. 0.95
SAMPLE_ROWS = 384  # input rows kept per slot (random over the calibration text)
# Calibration tokens whose inputs are sampled: the statistics pass runs the Python reference
# chain (minutes for thousands of tokens on 2 cores), and 384 rows need no more.
STATS_TOKENS = 2048
# Calibration tokens set aside for the search's perplexity (4 pass segments of 512; at most a
# fifth of the text).
SEARCH_TOKENS = 2044


def carve(ids: list[int], tokens: int, span: int) -> tuple[list[int], list[int]]:
    """(the rest of `ids`, `tokens` of them, at most a fifth, as evenly spaced runs of up to
    `span`): the carved runs are left out of everything else the calibration reads."""
    tokens = min(tokens, len(ids) // 5)
    run = min(span, tokens)
    if run < 2:
        return list(ids), []
    n = -(-tokens // run)
    step = (len(ids) - run) / max(1, n - 1)
    rest: list[int] = []
    carved: list[int] = []
    at = 0
    for begin in sorted({int(round(k * step)) for k in range(n)}):
        rest += ids[at:begin]
        carved += ids[begin: begin + run]
        at = begin + run
    return rest + ids[at:], carved


def spread(ids: list[int], tokens: int, span: int) -> list[int]:
    """`tokens` of `ids` as evenly spaced runs of up to `span` tokens (one pass segment
    each), so that statistics from a long text see all of it rather than only its start."""
    if len(ids) <= tokens:
        return list(ids)
    run = min(span, tokens)
    n = -(-tokens // run)
    step = (len(ids) - run) / max(1, n - 1)
    out: list[int] = []
    for k in range(n):
        begin = int(round(k * step))
        out += ids[begin: begin + min(run, tokens - len(out))]
    return out


@dataclass
class SlotStats:
    sample: torch.Tensor  # (rows, K) |x|, float32
    col_energy: torch.Tensor  # (K,) sum over the slot's weights of W[:, i]^2
    _order: tuple | None = field(default=None, repr=False)

    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(|x| ascending, the cumulative share of output energy up to each), made once."""
        if self._order is None:
            energy = (self.sample.double().pow(2) * self.col_energy.double()).flatten()
            values, order = self.sample.flatten().sort()
            cum = energy[order].cumsum(0)
            self._order = (values, cum / cum[-1].clamp_min(1e-300))
        return self._order

    def _index(self, level: float) -> int:
        return max(1, int(round(level * self.sample.numel()))) - 1

    def threshold(self, level: float) -> float:
        """The |x| below or at which `level` of the sampled inputs fall."""
        return 0.0 if level <= 0 else float(self._sorted()[0][self._index(level)])

    def error(self, level: float) -> float:
        """Share of the output energy carried by the inputs dropped at `level`."""
        return 0.0 if level <= 0 else float(self._sorted()[1][self._index(level)])


@contextlib.contextmanager
def reference_passes(model, matmul: Callable):
    """While inside, `model` (a FileBlocksModel) runs its passes through the Python reference
    chain with `matmul(layer, slot, x, weights)` computing every matmul."""
    saved = model.whole.run
    model.whole.run = functools.partial(decoder_step_reference, model.layers, matmul=matmul)
    try:
        yield model
    finally:
        model.whole.run = saved


@torch.inference_mode()
def collect_slot_stats(model, ids: list[int], bos: int | None, length: int,
                       seed: int = 0) -> dict[tuple[int, str], SlotStats]:
    """Sample each slot's |input| rows over `ids`, and its column energies."""
    rows: dict[tuple[int, str], list[torch.Tensor]] = {}

    def watch(i, slot, x, weights):
        rows.setdefault((i, slot), []).append(x.abs().half())
        return bm.block_matmul(x, weights)

    with reference_passes(model, watch):
        cache = model.new_cache(length)
        for seg in segments(ids, length, bos):
            cache.truncate(0)
            model.hidden(seg, cache)
    g = torch.Generator().manual_seed(seed)
    stats = {}
    for (i, slot), parts in rows.items():
        x = torch.cat(parts)
        pick = torch.randperm(x.shape[0], generator=g)[:SAMPLE_ROWS]
        energy = sum(w.dequantize().pow(2).sum(0) for w in slot_weights(model.layers[i], slot))
        stats[(i, slot)] = SlotStats(x[pick].float(), energy)
    return stats


@dataclass
class Allocation:
    levels: list[dict[str, float]]  # per layer: slot -> sparsity level
    thresholds: Thresholds

    def mean_sparsity(self) -> float:
        """Planned mean over the body's matmuls (q, k, v, o, gate, up, down each once)."""
        per = [sum(MATMULS[s] * lv[s] for s in SLOTS) / sum(MATMULS.values())
               for lv in self.levels]
        return sum(per) / max(1, len(per))


def allocate(stats: dict[tuple[int, str], SlotStats], n_layers: int, target: float) -> Allocation:
    """Per block, greedy: raise the slot whose next 5% costs the least error per matmul
    sparsity gained, until the block's matmul mean reaches `target`."""
    total = sum(MATMULS.values())
    levels = []
    for i in range(n_layers):
        at = {s: 0 for s in SLOTS}  # index into LEVELS
        errors = {s: [stats[(i, s)].error(lv) for lv in LEVELS] for s in SLOTS}
        while sum(MATMULS[s] * LEVELS[at[s]] for s in SLOTS) / total < target - 1e-9:
            movable = [s for s in SLOTS if at[s] + 1 < len(LEVELS)]
            if not movable:
                break
            best = min(movable, key=lambda s: (errors[s][at[s] + 1] - errors[s][at[s]])
                       / (MATMULS[s] * STEP))
            at[best] += 1
        levels.append({s: LEVELS[at[s]] for s in SLOTS})
    return from_levels(stats, levels)


def from_levels(stats, levels: list[dict[str, float]]) -> Allocation:
    """The thresholds realizing per-layer {slot: level} on the calibration sample."""
    return Allocation(levels, [{s: stats[(i, s)].threshold(lv[s]) for s in SLOTS if lv[s] > 0}
                               for i, lv in enumerate(levels)])


def allocate_uniform(stats, n_layers: int, target: float) -> Allocation:
    """Every slot of every layer at the level nearest `target` (the baseline)."""
    level = min(LEVELS, key=lambda lv: abs(lv - target))
    return from_levels(stats, [{s: level for s in SLOTS} for _ in range(n_layers)])


@dataclass
class InputCalibration:
    target: float  # the planned mean sparsity over the body's matmuls
    allocation: Allocation
    ppl_ratio: float  # on the calibration text set aside for the search, as agreement
    agreement: float
    dense_ppl: float
    tried: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict, repr=False)  # (layer, slot) -> SlotStats
    search_tokens: int = 0  # calibration tokens set aside for the search (carve)


ALLOCATIONS = ("global", "block", "uniform")


def allocator(method: str, model, runtime: InputSparsity, stats, train: list[int],
              bos: int | None, length: int, log: Callable[[str], None] = lambda m: None,
              probes: tuple[float, ...] = PROBES, kl_tokens: int = KL_TOKENS,
              probe_every: int = PROBE_EVERY) -> Callable[[float], Allocation]:
    """target -> Allocation by `method` (ALLOCATIONS). "global" first measures each slot's
    end-to-end cost on the calibration text (input_allocation.py: on every `probe_every`-th
    layer, one pass for the layer's floor and one per slot and probe level, each re-running
    the layers from the probed one)."""
    n = len(model.layers)
    if method == "uniform":
        return lambda target: allocate_uniform(stats, n, target)
    if method == "block":
        return lambda target: allocate(stats, n, target)
    if method != "global":
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {method!r}")
    chain = LayerChain(model, runtime)
    ref = dense_reference(chain, spread(train, kl_tokens, _span(length, bos)), bos, length,
                          kl_tokens)

    def kl_with(i: int, thresholds: dict[str, float]) -> float:
        for slot, value in thresholds.items():
            chain.threshold(i, slot, value)
        try:
            return kl_from_layer(chain, ref, i)
        finally:
            for slot in thresholds:
                chain.threshold(i, slot, None)

    costs = slot_costs(stats, n, kl_with, LEVELS, probes, probe_every, log=log)
    return lambda target: from_levels(stats, allocate_global(costs, n, target, LEVELS, STEP))


def calibrate_inputs(model, train: list[int], bos: int | None, budget: float, length: int,
                     log: Callable[[str], None] = lambda m: None,
                     steps: int = 6, layout: str = "tiles", method: str = "global",
                     stage: Stage = lambda name, fn: fn(), probe_every: int = PROBE_EVERY
                     ) -> tuple[InputCalibration, InputSparsity]:
    """Thresholds for `model` (a FileBlocksModel) at the highest target sparsity whose perplexity
    on calibration text set aside (`carve`) stays within 1 + budget of the dense model's;
    returns them with the runtime (left applied to the model at the chosen thresholds). Three
    stages, each run through
    `stage(name, fn)` (the profiler times them): "input statistics", "slot costs", "search"."""
    train, search = carve(train, SEARCH_TOKENS, _span(length, bos))
    if len(search) < 2:
        raise ConfigError(f"the calibration text has {len(train)} tokens: too few to set "
                          "some aside for the search; give more text")
    stats = stage("input statistics", lambda: collect_slot_stats(
        model, spread(train, STATS_TOKENS, _span(length, bos)), bos, length))
    log(f"statistics of {len(stats)} matmul inputs collected")
    runtime = apply_input_sparsity(model, [{} for _ in model.layers], layout)
    plan = stage("slot costs", lambda: allocator(method, model, runtime, stats, train, bos,
                                                 length, log, probe_every=probe_every))
    return stage("search", lambda: _search(model, runtime, plan, stats, search, bos, budget,
                                           length, steps, log))


def _search(model, runtime: InputSparsity, plan: Callable[[float], Allocation], stats,
            search: list[int], bos: int | None, budget: float, length: int, steps: int,
            log: Callable[[str], None]) -> tuple[InputCalibration, InputSparsity]:
    """Bisect the target on the set-aside text's perplexity (see the module's step 3)."""
    dense = score(model, search, length, bos)
    tried: list[dict] = []

    def measure(target: float):
        alloc = plan(target)
        runtime.set_thresholds(alloc.thresholds)
        runtime.reset_counters()
        s = score(model, search, length, bos)
        ratio, agree = s.ppl / dense.ppl, dense.agreement(s)
        sparsity = realized_means(runtime)  # as realized on the set-aside text
        tried.append({"target": round(target, 4), **sparsity,
                      "search_ppl_ratio": round(ratio, 4), "search_agreement": round(agree, 4)})
        log(f"target {target:.1%}: realized {sparsity['mean_body']:.1%} mean over the body's "
            f"matmuls ({sparsity['mean_body_by_bytes']:.1%} by bytes), set-aside calibration "
            f"text x{ratio:.4f}, top-1 agreement {agree:.1%}")
        return alloc, ratio, agree

    lo, hi = 0.0, 0.9
    best = (0.0, plan(0.0), 1.0, 1.0)  # dense: no thresholds
    for _ in range(steps):
        mid = (lo + hi) / 2
        alloc, ratio, agree = measure(mid)
        if ratio <= 1 + budget:
            lo, best = mid, (mid, alloc, ratio, agree)
        else:
            hi = mid
    target, alloc, ratio, agree = best
    runtime.set_thresholds(alloc.thresholds)
    return InputCalibration(target, alloc, ratio, agree, dense.ppl, tried, stats,
                            len(search)), runtime


def _span(length: int, bos: int | None) -> int:
    return length - (bos is not None)  # text tokens per pass segment (passes.segments)


def realized_means(runtime: InputSparsity) -> dict:
    """The sparsity the runtime's counters realized since their reset, as the mean over the
    body's matmuls (q, k, v, o, gate, up, down each counted once) and weighted by each
    matmul's bytes in the file (q/k/v and gate/up read more bytes per input than o)."""
    realized = runtime.realized()
    total = skipped = 0.0
    for i, row in enumerate(realized["per_layer"]):
        for slot in SLOTS:
            nbytes = sum(w.nbytes for w in slot_weights(runtime.model.layers[i], slot))
            total += nbytes
            skipped += nbytes * row[slot]
    return {"mean_body": realized["mean_body"],
            "mean_body_by_bytes": round(skipped / max(total, 1.0), 4)}
