"""Token trees for speculative decoding: the drafted candidates the target verifies at once.

Node 0 is the root: the last emitted token, whose K/V is not in the cache yet. Every other
node is a drafted continuation of its parent. Nodes are appended breadth-first, so a parent's
index is always below its children's. During a verification step node i occupies cache slot
context + i and is rotated as position context + depth(i) (SpecInfer's layout).

The expansion is written as in SpecInfer: "1,1,3,1" means each node at depth 0 and 1 gets one
child, each node at depth 2 gets three, each at depth 3 one: three branches four deep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.models.tree_rows import TreeRows

@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    # Final-normed target hidden state of each node once known (the self-drafter computes
    # them while drafting; verification computes the rest).
    hidden: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls([token], [-1], [0], [None])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """Append a child of `parent` (a no-op returning the existing one for a repeat)."""
        existing = self.children(parent).get(token)
        if existing is not None:
            return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.hidden.append(None)
        return len(self.tokens) - 1

    def children(self, node: int) -> dict[int, int]:
        """token -> node index of each child of `node`."""
        return {self.tokens[i]: i for i in range(node + 1, len(self.tokens))
                if self.parents[i] == node}

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def level(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: row i sees node j when j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def rows_for(self, context: int, first: int, count: int) -> TreeRows:
        """Placement of nodes first..first+count-1, verified together with a tree mask."""
        hi = first + count
        depths = torch.tensor(self.depths[:hi])
        return TreeRows(context, first, context + depths[first:hi], torch.arange(hi),
                        context + depths, self.ancestor_mask()[first:hi, :hi])

    def row_for(self, context: int, node: int) -> TreeRows:
        """Placement of one node given exactly its path: the keys plain decoding would see."""
        path = torch.tensor(self.path(node))
        depths = torch.tensor(self.depths)
        return TreeRows(context, node, context + depths[node: node + 1], path,
                        context + depths[path])
