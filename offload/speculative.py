"""Speculative decoding in the batch-1 loop: draft a token tree, verify it, accept, commit.

One step, as named phases: reserve tree slots -> draft (a `Drafter`) -> verify (target logits
at every node) -> accept (walk the tree with the target's own draws) -> commit (the accepted
path's K/V compacted to consecutive positions, the rest truncated).

The generator yields exactly what `Engine._steps` yields, (token, None) per token and
(None, reason) at an early end, so `Engine.stream()` needs no other change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .runner import Runner
from .sampler import Sampler
from .token_tree import TokenTree, tree_size


@dataclass
class SpecStats:
    drafter: str
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verification
    tree_nodes: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def to_dict(self) -> dict:
        steps = len(self.accepted)
        total = self.draft_s + self.verify_s
        return {
            "drafter": self.drafter,
            "verifications": steps,
            "accepted_per_step": self.accepted,
            # Tokens per verification: accepted drafts plus the target's own next token.
            "mean_accepted_length": (sum(self.accepted) + steps) / steps if steps else 0.0,
            "mean_tree_nodes": sum(self.tree_nodes) / steps if steps else 0.0,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "drafter_time_share": self.draft_s / total if total > 0 else 0.0,
        }


class TreeSizer:
    """Depth of the next tree from measured acceptance (drafting and verifying are not free
    on a CPU): grows toward the configured expansion while drafts are accepted, shrinks to
    about the recent accepted length when they are not, and drafts nothing while almost
    nothing is accepted, probing with one level every few steps."""

    PROBE_EVERY = 4

    def __init__(self, widths: tuple[int, ...]):
        self.widths = widths
        self.mean = float(len(widths))  # running mean of accepted drafts per step
        self.idle = 0  # steps since the last draft

    def next_widths(self) -> tuple[int, ...]:
        if self.mean < 0.3:
            self.idle += 1
            return self.widths[:1] if self.idle % self.PROBE_EVERY == 0 else ()
        return self.widths[: min(len(self.widths), math.ceil(self.mean) + 1)]

    def update(self, accepted: int, drafted: bool = True) -> None:
        if drafted:
            self.mean = 0.5 * self.mean + 0.5 * accepted


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


def speculative_steps(runner: Runner, session: str, drafter, sizer: TreeSizer, sampler: Sampler,
                      prompt_ids: list[int], max_tokens: int, stop_ids: set[int], timings,
                      cancel, stats: SpecStats):
    """Yield (token, None) per generated token, then (None, finish_reason) if it ends early."""
    t0 = time.perf_counter()
    logits = runner.prefill(session, list(prompt_ids))
    timings.prefill_s = time.perf_counter() - t0
    drafter.start(runner, session, list(prompt_ids))
    history = list(prompt_ids)
    queue = [sampler(logits, history)]
    emitted = 0
    while True:
        token = queue.pop(0)
        if cancel is not None and cancel.is_set():
            yield None, "cancelled"
            return
        if token in stop_ids:
            yield None, "eos"
            return
        history.append(token)
        yield token, None
        emitted += 1
        if emitted == max_tokens:
            return
        if queue:
            continue
        if len(runner.tokens(session)) >= runner.n_ctx:
            yield None, "context"
            return
        queue = _step(runner, session, drafter, sizer, sampler, history, max_tokens - emitted, stats)


def _step(runner, session, drafter, sizer, sampler, history, remaining, stats) -> list[int]:
    """One draft -> verify -> accept -> commit round rooted at history[-1]; returns the
    target's tokens for the positions after it (accepted drafts, then its own next token)."""
    widths = sizer.next_widths()[: max(remaining - 1, 0)]  # () -> a plain decode step
    t0 = time.perf_counter()
    room = runner.begin_tree(session, tree_size(widths))
    tree = drafter.draft(runner, session, history, widths, room) if widths else TokenTree.root(history[-1])
    t1 = time.perf_counter()
    logits = runner.verify(session, tree)
    path, drawn = accept(tree, logits, sampler, history)
    runner.commit_path(session, tree, path)
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.accepted.append(len(path) - 1)
    stats.tree_nodes.append(len(tree))
    sizer.update(len(path) - 1, len(tree) > 1)
    return drawn
