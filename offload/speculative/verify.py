"""Speculative decoding's step in the shared decode loop: draft a token tree, verify it,
accept, commit.

One step, as named phases: reserve tree slots -> draft (a `Drafter`) -> verify (target logits
at every node) -> accept (walk the tree with the target's own draws) -> commit (the accepted
path's K/V compacted to consecutive positions, the rest truncated). `decode/loop.py` runs it
exactly as it runs a plain step: prefill, stop conditions and timing live there.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..decode.loop import PlainStep
from ..decode.runner import Runner
from ..decode.sampler import Sampler
from ..options.tree_spec import tree_size
from .token_tree import TokenTree


@dataclass
class SpecStats:
    drafter: str
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verification
    tree_nodes: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # drafting, catch-up included
    verify_s: float = 0.0
    catchup_s: float = 0.0  # a draft model's cache catching up with the target's tokens

    def to_dict(self) -> dict:
        steps = len(self.accepted)
        total = self.draft_s + self.verify_s
        return {
            "drafter": self.drafter,
            "verifications": steps,
            "accepted_per_step": self.accepted,
            # Tokens per verification: accepted drafts plus the target's own next token.
            "mean_accepted_length": (sum(self.accepted) + steps) / steps if steps else 0.0,
            "tree_nodes_per_step": self.tree_nodes,  # 1: a plain step (nothing drafted)
            "mean_tree_nodes": sum(self.tree_nodes) / steps if steps else 0.0,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "catchup_s": self.catchup_s,
            "drafter_time_share": self.draft_s / total if total > 0 else 0.0,
        }


class TreeSizer:
    """How many levels the next draft gets, from what drafting has measurably bought.

    On a CPU neither drafting nor verifying is free: a verified row past the first turns the
    matmuls compute-bound (~0.3 of a plain step each for the default model here), and a
    drafter pays a body pass per level. So each step the sizer weighs, per level, the chance
    the level is accepted (p**k, with p the measured per-level acceptance) against its cost
    (the extra seconds per drafted level, in plain steps), and drafts the levels that pay.
    When none does it decodes plainly, probing with one level now and then (more rarely
    while probes fail, but at least every MAX_PROBE_EVERY steps: it never stops for good) so
    both estimates stay current. The first step is plain: it measures what a step costs.

    Costs are medians of the latest WINDOW samples: one slow step (another process, a page
    fault, a draft cache catching up) cannot make drafting look too dear to ever try again.
    The engine keeps one sizer across replies.
    """

    PROBE_EVERY, MAX_PROBE_EVERY = 4, 16
    DECAY = 0.7  # weight of the past in the acceptance estimate
    WINDOW = 9  # cost samples a median is taken over
    # Until measured: half the levels accepted, a level costing 0.3 of a step (a verified row
    # on the default model here). The first draft is then one level, and depth grows as
    # drafts are accepted, rather than paying for a deep tree of guesses up front.
    PRIOR_P, PRIOR_COST = 0.5, 0.3

    def __init__(self, widths: tuple[int, ...]):
        self.widths = widths
        self.hits, self.trials = self.PRIOR_P, 1.0  # accepted levels / levels tried
        self.steps: deque[float] = deque(maxlen=self.WINDOW)  # plain steps' seconds
        self.levels: deque[float] = deque(maxlen=self.WINDOW)  # extra seconds per level
        self.idle = 0  # plain steps since the last draft or probe
        self.probe_every = self.PROBE_EVERY

    @property
    def p(self) -> float:
        return self.hits / self.trials

    @property
    def step_s(self) -> float | None:
        """A plain step's seconds (None until one was timed)."""
        return statistics.median(self.steps) if self.steps else None

    def level_cost(self) -> float:
        """A drafted level's cost in plain steps."""
        if not self.levels or not self.step_s:
            return self.PRIOR_COST
        return statistics.median(self.levels) / self.step_s

    def next_widths(self) -> tuple[int, ...]:
        if self.step_s is None:
            return ()
        p, cost, depth, nodes = self.p, self.level_cost(), 0, 1
        for width in self.widths:
            nodes *= width
            if p ** (depth + 1) <= cost * nodes:
                break
            depth += 1
        if depth:
            self.idle, self.probe_every = 0, self.PROBE_EVERY
            return self.widths[:depth]
        self.idle += 1
        if self.idle < self.probe_every:
            return ()
        # A probe; the next comes later (up to MAX_PROBE_EVERY steps) while they keep
        # showing drafting does not pay: each costs a drafted level and a verified row.
        self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)
        self.idle = 0
        return self.widths[:1]

    def update(self, levels: int, accepted: int, seconds: float) -> None:
        """After a step that drafted `levels` levels (0: a plain step) and took `seconds`
        (without the drafter's catch-up: that is no level's cost)."""
        if levels == 0:
            self.steps.append(seconds)
            return
        # Accepted levels succeeded; the level after them, if drafted, failed.
        d = self.DECAY
        self.hits = d * self.hits + accepted
        self.trials = d * self.trials + accepted + (accepted < levels)
        self.levels.append(max(0.0, seconds - (self.step_s or 0.0)) / levels)


def accept(tree: TokenTree, logits: torch.Tensor, sample, history: list[int]):
    """Walk the tree from the root; returns (path of accepted nodes, target tokens drawn).

    At each node the target draws its own next token exactly as plain decoding would; if a
    child carries that token, it is accepted and the walk goes on. For a deterministic draft
    this is SpecInfer's multi-step speculative sampling: child c is accepted with probability
    p(c), and after a rejection the draw comes from p with the rejected children removed, so
    the output distribution is the target's (greedy: token for token; seeded: draw for draw).
    """
    path, drawn = [0], []
    while True:
        token = sample(logits[path[-1]], history + drawn)
        drawn.append(token)
        child = tree.children(path[-1]).get(token)
        if child is None:
            return path, drawn
        path.append(child)


class SpeculativeStep:
    """The step of speculative decoding (see `decode/loop.py`): one draft -> verify ->
    accept -> commit round rooted at the last token, returning the target's tokens after it
    (accepted drafts, then its own next token). With nothing to draft it is a plain step
    (the same logits as a one-node tree), timed for the sizer."""

    def __init__(self, runner: Runner, session: str, sampler: Sampler, drafter,
                 sizer: TreeSizer, stats: SpecStats):
        self.plain = PlainStep(runner, session, sampler)
        self.runner, self.session, self.sampler = runner, session, sampler
        self.drafter, self.sizer, self.stats = drafter, sizer, stats

    def first(self, logits: torch.Tensor, history: list[int]) -> list[int]:
        self.drafter.start(self.runner, self.session, list(history))
        return self.plain.first(logits, history)

    def next(self, history: list[int], remaining: int) -> list[int]:
        widths = self.sizer.next_widths()[: max(remaining - 1, 0)]
        t0 = time.perf_counter()
        tree = self._draft(history, widths) if widths else None
        if tree is None:
            drawn = self.plain.next(history, remaining)
            seconds = time.perf_counter() - t0
            self.stats.verify_s += seconds
            self.stats.accepted.append(0)
            self.stats.tree_nodes.append(1)
            self.sizer.update(0, 0, seconds)
            return drawn
        t1 = time.perf_counter()
        logits = self.runner.verify(self.session, tree)
        path, drawn = accept(tree, logits, self.sampler, history)
        # A drafter's extra levels may run past the tokens still wanted: keep what is.
        path, drawn = path[:remaining], drawn[:remaining]
        self.runner.commit_path(self.session, tree, path)
        t2 = time.perf_counter()
        catchup = self.drafter.catchup_s
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.catchup_s += catchup
        self.stats.accepted.append(len(path) - 1)
        self.stats.tree_nodes.append(len(tree))
        # Levels a drafter adds past those asked for (the lookup's, in a combined tree) count
        # as levels: their rows are in the cost, so their tokens must be in the gain, or a
        # deep accepted lookup would read as dear levels and stop the drafting that found it.
        if max(tree.depths):
            self.sizer.update(max(tree.depths), len(path) - 1, t2 - t0 - catchup)
        return drawn

    def _draft(self, history: list[int], widths: tuple[int, ...]) -> TokenTree | None:
        """The drafter's tree in slots reserved after the context; None when nothing was
        drafted (prompt lookup found no match) and nothing computed: then a plain step
        follows, without a one-node tree's bookkeeping. (A drafter with nothing to offer
        tells the sizer nothing about drafting.)"""
        room = self.runner.begin_tree(self.session,
                                      tree_size(widths) + self.drafter.extra_nodes())
        tree = self.drafter.draft(self.runner, self.session, history, widths, room)
        if len(tree) == 1 and tree.hidden[0] is None:
            self.runner.end_tree(self.session)
            return None
        return tree
