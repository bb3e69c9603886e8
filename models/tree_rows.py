"""Where the rows of a speculative token tree sit in the cache, and what each of them reads.

Used by the reference attention (models/transformer.py) and the file-blocks runtime
(offload/body/file_blocks_model.py), which reads each row's keys from the paged pool in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TreeRows:
    """How T rows of a token tree (speculative verification) sit in the cache.

    The committed context holds positions 0..context-1 in slots of the same index. Tree node i
    has its K/V written to slot context + i, but is rotated as position context + depth(i).
    Rows are nodes first..first+T-1; `keys` are the tree-node indices the rows may attend to
    (after the context), `mask` (T, len(keys)) which of them each row sees (its ancestors and
    itself); None when every row sees every key (a single row given exactly its path).
    """

    context: int
    first: int
    positions: torch.Tensor  # (T,) rotary positions of the rows
    keys: torch.Tensor  # (S,) tree-node indices of the visible tree keys
    key_positions: torch.Tensor  # (S,)
    mask: torch.Tensor | None = None  # (T, S) bool
    # What every layer of one pass would otherwise work out again (the positions each row
    # reads, per window size; rotary tables): ~0.1 ms a layer for a tree row.
    memo: dict = field(default_factory=dict, repr=False, compare=False)


def tree_span(tree: TreeRows, window: int | None) -> tuple[int, int]:
    """Positions [lo, end) any row of `tree` may read under `window`: context and tree slots."""
    c = tree.context
    lo = 0 if window is None else max(0, int(tree.positions.min()) - window + 1)
    return min(lo, c), c + int(tree.keys.max()) + 1


def tree_keys(tree: TreeRows, window: int | None, lo: int):
    """Per row: (first context position it sees, indices of the tree keys it sees)."""
    for r in range(tree.positions.shape[0]):
        pos = int(tree.positions[r])
        sel, k_pos = tree.keys, tree.key_positions
        if tree.mask is not None:
            sel, k_pos = sel[tree.mask[r]], k_pos[tree.mask[r]]
        first = lo
        if window is not None:
            first = min(max(lo, pos - window + 1), tree.context)
            inside = k_pos > pos - window
            sel = sel[inside]
        yield first, sel


def tree_positions(tree: TreeRows, window: int | None) -> tuple[list[torch.Tensor], int]:
    """Per tree row, the cache positions it reads: the context inside its window, then the
    tree keys it sees (node i sits at position context + i), its own last; and one past the
    largest. The same for every layer with this window: worked out once per pass."""
    key = ("positions", window)
    if key not in tree.memo:
        lo, end = tree_span(tree, window)
        c = tree.context
        tree.memo[key] = ([torch.cat((torch.arange(first, c), c + sel))
                           for first, sel in tree_keys(tree, window, lo)], end)
    return tree.memo[key]
