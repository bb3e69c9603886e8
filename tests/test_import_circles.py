"""No room of offload/ has an import circle among its files at run time: a module imported
inside a function counts (it runs when the function does); one imported under
`if TYPE_CHECKING:` does not. Read with `ast`, as tests/test_layering.py reads imports."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROOMS = sorted(p.name for p in (ROOT / "offload").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file())


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else \
                test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _room_imports(room: str, path: pathlib.Path) -> set[str]:
    """Modules of `room` (by file stem) that `path` imports at run time."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    prefix = f"ember.offload.{room}."
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom):
            if isinstance(node, ast.Import) and id(node) not in skip:
                out |= {a.name[len(prefix):].split(".")[0] for a in node.names
                        if a.name.startswith(prefix)}
            continue
        if node.level == 1:  # from .x import y / from . import x, y
            names = [node.module] if node.module else [a.name for a in node.names]
            out |= {n.split(".")[0] for n in names}
        elif node.level == 0 and node.module and node.module.startswith(prefix):
            out.add(node.module[len(prefix):].split(".")[0])
        elif node.level == 0 and node.module == prefix[:-1]:
            out |= {a.name for a in node.names}
    return out - {"__init__"}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_reader_finds_a_circle_and_ignores_type_checking_imports(tmp_path):
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a"}}) is None
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom .b import x\n"
                   "if TYPE_CHECKING:\n    from .c import y\n"
                   "def f():\n    from ember.offload.hybrid.d import z\n")
    assert _room_imports("hybrid", src) == {"b", "d"}


@pytest.mark.parametrize("room", ROOMS)
def test_no_run_time_import_circle_inside_a_room(room):
    files = {p.stem: p for p in (ROOT / "offload" / room).glob("*.py") if p.stem != "__init__"}
    graph = {name: _room_imports(room, path) & set(files) for name, path in files.items()}
    circle = _circle(graph)
    assert circle is None, f"offload/{room}: " + " -> ".join(f"{m}.py" for m in circle)
