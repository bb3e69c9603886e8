"""Drafting with a separate small model that shares the target's tokenizer.

The draft model runs in its own runner and KV cache (session `DRAFT`), which keeps pace with
the target's tokens: its prompt is prefilled with the target's (`start`), the nodes of each
draft that the target accepts keep their K/V (committed, not recomputed), and whatever it
lacks (the leaf of a fully accepted draft, the tokens of plain steps) is computed at the next
draft: with its first level when it is a few tokens, else in a pass of its own, timed apart
as catch-up (`catchup_s`) so the tree sizer never books it as the cost of a drafted level.

Each level of the draft tree is one pass of the draft model over that level's nodes (a
tree-masked batch, as verification does for the target), scored by a shortlist head: the
0.5B Qwen's output layer is 28% of its bytes, and a head over the ~32k lowest ids (BPE merge
order: the common pieces), the context's tokens and the stop tokens reads a fifth of that.
The target verifies every node, so the draft's head only changes how much is accepted.
"""

from __future__ import annotations

import time

import torch

from ember.models.support.errors import ConfigError

from ..decode.runner import Runner
from .drafters import DEFAULT_SHORTLIST, LookupDrafter, ShortlistHead, top_children
from .token_tree import TokenTree

DRAFT = "draft"  # the draft runner's one session
# Tokens the draft cache may lack that the next draft's first pass computes with its root
# (the leaf of a fully accepted draft, the target's token after a plain step): more than
# that is a catch-up pass of its own, timed apart.
MERGED_LAG = 4


class ModelDrafter:
    """Draft token trees with a small model of the same tokenizer (see the module)."""

    name = "model"

    def __init__(self, runner: Runner, stop_ids: tuple[int, ...] = (),
                 shortlist: int = DEFAULT_SHORTLIST):
        self.runner = runner
        self.head = ShortlistHead(runner.model, shortlist, always=stop_ids)
        self.catchup_s = 0.0  # the latest draft's catch-up seconds (not a level's cost)
        self._tree: TokenTree | None = None  # the latest draft: its nodes' K/V are reserved
        self._added = 0  # history tokens the shortlist has seen

    def extra_nodes(self) -> int:
        return 0

    def start(self, runner: Runner, session: str, prompt_ids: list[int]) -> None:
        """Prefill the prompt into the draft cache (with the target's: time to first token)."""
        self._drop_tree()
        if len(prompt_ids) < self.runner.n_ctx:  # (else the draft model's context is full)
            self.runner.sync(DRAFT, list(prompt_ids))
        self.head.add(prompt_ids)
        self._added = len(prompt_ids)

    def draft(self, runner, session, history, widths, max_nodes) -> TokenTree:
        if len(history) + MERGED_LAG >= self.runner.n_ctx:  # its context (maybe shorter) is full
            self._drop_tree()
            self.catchup_s = 0.0
            return TokenTree.root(history[-1])
        t0 = time.perf_counter()
        lag = self._catch_up(history[:-1])
        self.catchup_s = time.perf_counter() - t0
        self.head.add(history[self._added:])
        self._added = len(history)
        # The draft's own tree: the few tokens its cache lacks as a chain, then the root, so
        # they share the first level's pass.
        room = self.runner.begin_tree(DRAFT, max_nodes + len(lag))
        chain = lag + history[-1:]
        tree = TokenTree.root(chain[0])
        for token in chain[1:]:
            tree.add(len(tree) - 1, token)
        first = len(lag)  # the target's root in it
        frontier = [first] if room > first else []  # (no room: the context is full)
        for width in widths:
            if not frontier or len(tree) >= room:
                break
            self.runner.tree_hidden(DRAFT, tree)  # the new level's nodes, one pass
            ranked = self.head.top(torch.cat([tree.hidden[i] for i in frontier]), width)
            frontier = [c for node, tokens in zip(frontier, ranked)
                        for c in top_children(tree, node, tokens, width, room)]
        self._tree = tree
        # The target's tree: the nodes from its root on, its own hidden states to compute.
        n = len(tree) - first
        return TokenTree(tree.tokens[first:], [-1] + [p - first for p in tree.parents[first + 1:]],
                         [d - first for d in tree.depths[first:]], [None] * n)

    def _catch_up(self, ids: list[int]) -> list[int]:
        """Bring the draft cache up to `ids` (the target's history before the root): keep
        the latest draft's nodes along what was accepted, then compute what is still missing
        in one pass, unless it is at most MERGED_LAG tokens: those are returned, for the
        first level's pass."""
        tree, self._tree = self._tree, None
        if tree is not None:
            base = len(self.runner.tokens(DRAFT))
            path = [0] if len(ids) > base and ids[base] == tree.tokens[0] else []
            for token in ids[base + 1:] if path else ():
                child = tree.children(path[-1]).get(token)
                if child is None or tree.hidden[child] is None:  # leaves were never run
                    break
                path.append(child)
            if path and tree.hidden[0] is not None:
                self.runner.commit_path(DRAFT, tree, path)
            else:
                self.runner.end_tree(DRAFT)
        held = self.runner.tokens(DRAFT)
        if len(held) <= len(ids) <= len(held) + MERGED_LAG and ids[:len(held)] == held:
            return ids[len(held):]
        self.runner.sync(DRAFT, ids)
        return []

    def _drop_tree(self) -> None:
        if self._tree is not None:
            self.runner.end_tree(DRAFT)
            self._tree = None


class CombinedDrafter:
    """Prompt lookup and a draft model in one tree: the model's tree (sized by the tree
    sizer), extended by the lookup's continuation where the two agree. Code answers repeat
    their prompt's names, signatures and docstrings, where lookup runs many tokens deep;
    where the draft model's own levels disagree with the lookup, the model is the better
    judge (each extra node costs a verified row), so the lookup's tokens are kept only past
    the model's deepest node along a path they match, up to `lookup_depth` more nodes."""

    name = "model+lookup"

    def __init__(self, model: ModelDrafter, lookup: LookupDrafter, lookup_depth: int = 8):
        self.model, self.lookup, self.lookup_depth = model, lookup, lookup_depth

    @property
    def catchup_s(self) -> float:
        return self.model.catchup_s

    def extra_nodes(self) -> int:
        """Tree slots beyond the model's widths that the lookup's continuation may fill."""
        return self.lookup_depth

    def start(self, runner: Runner, session: str, prompt_ids: list[int]) -> None:
        self.model.start(runner, session, prompt_ids)

    def draft(self, runner, session, history, widths, max_nodes) -> TokenTree:
        tree = self.model.draft(runner, session, history, widths,
                                max(1, max_nodes - self.lookup_depth))
        if self.lookup_depth == 0:
            return tree
        depth = len(widths) + self.lookup_depth
        found = self.lookup.draft(runner, session, history, (1,) * depth, depth + 1)
        node = 0
        for token in found.tokens[1:]:  # one chain: the latest, longest match
            children = tree.children(node)
            if token in children:
                node = children[token]
            elif children or len(tree) >= max_nodes:
                break  # the model drafted something else here
            else:
                node = tree.add(node, token)
        return tree


def check_same_tokenizer(target, draft, path: str) -> None:
    """Refuse a draft model whose vocabulary differs: its token ids would mean other text."""
    if target.vocab_size != draft.vocab_size or any(
            target.token_bytes(i) != draft.token_bytes(i) for i in range(target.vocab_size)):
        raise ConfigError(f"the draft model {path} does not use the target model's tokenizer "
                          f"({draft.vocab_size} vs {target.vocab_size} tokens, or different "
                          "pieces); choose a draft model from the same family")
