"""Drafters: cheap guesses of the next tokens, as a token tree the target model then verifies.

All share one call, `draft(runner, session, history, widths, max_nodes) -> TokenTree`,
where `history` ends with the tree's root (the last emitted token) and `widths` is the
expansion per depth (see token_tree). A drafter may leave target hidden states in the tree
(the self-drafter does: its body passes are the target's own), and verification reuses them.
Each also says how many tree slots it may fill beyond `widths` (`extra_nodes`) and how long
its latest draft spent catching up rather than drafting (`catchup_s`).

- `LookupDrafter`: prompt lookup, the continuation of earlier occurrences of the last n-gram.
- `SelfDrafter`: the target's own body with a shortlisted-vocabulary LM head. The 262k-token
  head is ~72% of the bytes a default-model decode step reads; a head over the ~16k most
  likely tokens plus every token seen in the context reads a sixteenth of that.
- `ModelDrafter` (offload/speculative/model_drafter.py): a separate small model that shares
  the target's tokenizer.
"""

from __future__ import annotations

import torch

from ..body.file_layers import BlockLMHead
from ..decode.runner import Runner
from .token_tree import TokenTree

DEFAULT_SHORTLIST = 32768


def top_children(tree: TokenTree, node: int, ranked: list[int], width: int, room: int) -> list[int]:
    """Add up to `width` children of `node` from `ranked` tokens (best first) while room lasts."""
    added = []
    for token in ranked[:width]:
        if len(tree) >= room:
            break
        added.append(tree.add(node, token))
    return added


class LookupDrafter:
    """Prompt lookup: find earlier occurrences of the context's last n tokens (longest n
    first, most recent occurrence first) and draft what followed them, as a trie. A single
    matching token is weak evidence on prose (it drafts mostly rejected chains), hence
    min_ngram 2."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, max_matches: int = 4):
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    catchup_s = 0.0  # nothing to catch up: it drafts from the target's own state

    def extra_nodes(self) -> int:
        return 0

    def start(self, runner: Runner, session: str, prompt_ids: list[int]) -> None:
        pass

    def draft(self, runner, session, history, widths, max_nodes) -> TokenTree:
        tree = TokenTree.root(history[-1])
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            for cont in self._continuations(history, n, len(widths)):
                node = 0
                for token in cont:
                    child = tree.children(node).get(token)
                    if child is None:
                        if len(tree.children(node)) >= widths[tree.depths[node]] or len(tree) >= max_nodes:
                            break
                        child = tree.add(node, token)
                    node = child
            if len(tree) > 1:
                break
        return tree

    def _continuations(self, history: list[int], n: int, depth: int) -> list[list[int]]:
        tail, end = history[-n:], len(history) - n
        found = []
        for i in range(end - 1, -1, -1):
            if history[i: i + n] == tail:
                found.append(history[i + n: i + n + depth])
                if len(found) == self.max_matches:
                    break
        return found


class ShortlistHead:
    """The target's LM head restricted to a token shortlist (draft quality, not exact).

    Base rows (the lowest ids: Gemma-style vocabularies put frequent pieces first) are built
    once; tokens seen in the context are added as they appear, which matters most: without
    them a shortlist misses names and rare words the continuation repeats.
    """

    def __init__(self, model, size: int, always: tuple[int, ...] = ()):
        """`model`: the engine's model (FileBlocksModel or the float Transformer); `always`: ids
        past the base rows that belong in it anyway (end-of-turn tokens sit at the end of
        BPE vocabularies)."""
        self.model = model
        # A head the runtime keeps in host RAM (hybrid.setup.HostLMHead) wraps the real one.
        self.head = getattr(model.head, "inner", model.head)
        self.stored = self.head.stored
        vocab = self.stored.shape[0]
        self.base_ids = torch.arange(min(size, vocab))
        self.base = self._rows(self.base_ids)
        self.extra_ids: list[int] = []
        self.extra = self._rows(torch.tensor([], dtype=torch.long))
        self._known = set(range(len(self.base_ids)))
        self.add([t for t in always if 0 <= t < vocab])

    def _rows(self, ids: torch.Tensor):
        if isinstance(self.head, BlockLMHead):
            return self.stored.select_rows(ids)  # (S, vocab rows) in the file's blocks
        return self.stored.dequantize_rows(ids).t().contiguous().to(self.model.device)  # (H, S)

    def add(self, tokens: list[int]) -> None:
        new = sorted({t for t in tokens if t not in self._known})
        if new:
            self._known.update(new)
            self.extra_ids += new
            self.extra = self._rows(torch.tensor(self.extra_ids, dtype=torch.long))

    def _logits(self, hidden: torch.Tensor, rows) -> torch.Tensor:
        if isinstance(self.head, BlockLMHead):
            return self.head.scores(hidden, rows)
        if rows.numel() == 0:
            return hidden.new_empty(hidden.shape[0], 0)
        return hidden @ rows

    def top(self, hidden: torch.Tensor, k: int) -> list[list[int]]:
        """Best k token ids (best first) for each row of hidden (T, H)."""
        logits = torch.cat((self._logits(hidden, self.base), self._logits(hidden, self.extra)), 1)
        ids = torch.cat((self.base_ids, torch.tensor(self.extra_ids, dtype=torch.long)))
        top = torch.topk(logits, min(k, logits.shape[1]), dim=1).indices.cpu()
        return ids[top].tolist()


class SelfDrafter:
    """The target's own body, one node at a time, with a shortlist head choosing children.

    The body passes are the target's exact computation for those nodes, so verification only
    has to run the full head over them; the draft cost is the body plus a small head.
    """

    name = "self"

    def __init__(self, model, shortlist: int = DEFAULT_SHORTLIST):
        self.model, self.shortlist = model, shortlist
        self.head: ShortlistHead | None = None

    catchup_s = 0.0  # nothing to catch up: it drafts from the target's own state

    def extra_nodes(self) -> int:
        return 0

    def start(self, runner: Runner, session: str, prompt_ids: list[int]) -> None:
        if self.head is None:
            self.head = ShortlistHead(self.model, self.shortlist)
        self.head.add(prompt_ids)
        self._added = len(prompt_ids)

    def draft(self, runner, session, history, widths, max_nodes) -> TokenTree:
        self.head.add(history[self._added:])  # every token emitted since the last draft
        self._added = len(history)
        tree, frontier = TokenTree.root(history[-1]), [0]
        for width in widths:
            if not frontier or len(tree) >= max_nodes:
                break
            runner.tree_hidden(session, tree)
            ranked = self.head.top(torch.cat([tree.hidden[i] for i in frontier]), width)
            frontier = [c for node, tokens in zip(frontier, ranked)
                        for c in top_children(tree, node, tokens, width, max_nodes)]
        return tree
