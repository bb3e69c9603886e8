"""A draft tree's shape as `--tree` writes it: children per node at each depth."""

from __future__ import annotations

from ember.models.support.errors import ConfigError

# Verification runs every node of a tree as one batch of rows.
MAX_TREE_NODES = 256


def parse_tree(spec: str) -> tuple[int, ...]:
    """"1,1,3,1" -> (1, 1, 3, 1): children per node at each depth (the root is depth 0)."""
    try:
        widths = tuple(int(part) for part in spec.replace(" ", "").split(","))
    except ValueError:
        raise ConfigError(f"--tree takes comma-separated positive integers such as 1,1,3,1; "
                          f"got {spec!r}") from None
    if not widths or min(widths) < 1:
        raise ConfigError(f"--tree takes comma-separated positive integers such as 1,1,3,1; "
                          f"got {spec!r}")
    if tree_size(widths) > MAX_TREE_NODES:
        raise ConfigError(f"--tree {spec} has {tree_size(widths)} nodes; at most "
                          f"{MAX_TREE_NODES} are supported (use fewer or narrower levels)")
    return widths


def tree_size(widths: tuple[int, ...]) -> int:
    """Nodes in a full tree of this expansion, the root included."""
    total, level = 1, 1
    for w in widths:
        level *= w
        total += level
    return total
