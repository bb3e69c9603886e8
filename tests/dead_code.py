"""Find public functions, methods and classes nothing outside tests/ refers to.

The check is by name, read with `ast` (nothing is imported, so it takes about a second of
CPU): a definition is alive when its name is used anywhere in non-test code other than
inside its own body, as a plain name (`f(x)`, `Engine`), an attribute (`x.step`), a string
that is exactly the name (`getattr(m, "main")`, `"Engine"` annotations), a Textual action
string (`"app.quit"` for `action_quit`), or an entry point in pyproject.toml; methods a
framework calls by convention (Textual's `on_*`, `compose`, `@on` handlers, torch's
`forward`) need no caller. Matching by name
errs on the side of "alive" (any `x.run` keeps every `run` alive), so what it reports is
dead; a reference made only from dead code does not count, so a dead caller does not hide
a dead callee.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from dataclasses import dataclass

# Methods a framework calls by convention, never by name in our code.
FRAMEWORK_PREFIXES = (
    "on_",        # Textual message handlers
    "watch_",     # Textual reactive watchers
    "validate_",  # Textual reactive validators
    "compute_",   # Textual computed reactives
    "visit_",     # ast.NodeVisitor
)
FRAMEWORK_NAMES = {
    "compose", "render", "render_line", "check_action",  # Textual
    "forward", "extra_repr",  # torch.nn.Module: called through module(x) and repr()
    "run",  # threading.Thread
}
# Decorators that register a method with a framework, which then calls it: Textual's `@on`.
REGISTERING_DECORATORS = {"on"}
ACTION = re.compile(r"(?:^|[.\s(=])([a-z_][a-z0-9_]*)(?:\(|$)")


@dataclass(frozen=True)
class Definition:
    """One public `def` or `class`: `name` as written, `qualname` with its class."""

    path: pathlib.Path
    qualname: str
    name: str
    first: int
    last: int
    kind: str  # "function", "method" or "class"
    decorators: tuple[str, ...] = ()

    def key(self, root: pathlib.Path) -> str:
        """How allow-lists name it: "models/testing/synthetic.py::write_hf"."""
        return f"{self.path.relative_to(root).as_posix()}::{self.qualname}"

    def where(self, root: pathlib.Path) -> str:
        return f"{self.path.relative_to(root).as_posix()}:{self.first} {self.qualname}"

    def encloses(self, path: pathlib.Path, line: int) -> bool:
        return path == self.path and self.first <= line <= self.last


def definitions(path: pathlib.Path, tree: ast.Module):
    """Module-level functions and classes, and the methods of classes (nested too)."""

    def walk(body, prefix):
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            is_class = isinstance(node, ast.ClassDef)
            kind = "class" if is_class else ("method" if prefix else "function")
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield Definition(path, prefix + node.name, node.name, first, node.end_lineno, kind,
                             tuple(_decorator_name(d) for d in node.decorator_list))
            if is_class:
                yield from walk(node.body, prefix + node.name + ".")

    yield from walk(tree.body, "")


def parse(path: pathlib.Path) -> ast.Module:
    """The file's syntax tree, parsed once per version of the file (the checks share it)."""
    return _parse(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _parse(path: pathlib.Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _decorator_name(node: ast.expr) -> str:
    """`on` for `@on(Button.Pressed)`, `property` for `@property`, `inference_mode` for
    `@torch.inference_mode()`."""
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _is_dunder_all(node: ast.AST) -> bool:
    return isinstance(node, (ast.Assign, ast.AugAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__"
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))


def references(path: pathlib.Path, tree: ast.Module):
    """(name, line) for every name this module uses. `__all__` lists and imports are not
    uses: re-exporting a name is no caller."""
    skip = {id(n) for node in tree.body if _is_dunder_all(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.isidentifier():
                yield text, node.lineno
            if len(text) < 200:
                # Textual action strings: "quit", "app.quit", "screen.toggle('x')"
                for action in ACTION.findall(text):
                    yield "action_" + action, node.lineno


def entry_points(pyproject: pathlib.Path):
    """The function names `module:function` entry points in pyproject.toml call."""
    if not pyproject.exists():
        return
    for match in re.finditer(r'=\s*"[\w.]+:(\w+)"', pyproject.read_text()):
        yield match.group(1)


def non_test_sources(root: pathlib.Path) -> list[pathlib.Path]:
    """The Python files of the project outside tests/ (not walking .venv or build trees)."""
    top = [p for p in root.iterdir()
           if p.is_dir() and p.name != "tests" and not p.name.startswith((".", "build"))]
    return sorted([*root.glob("*.py"), *(p for d in top for p in d.rglob("*.py"))])


def _is_framework_hook(d: Definition) -> bool:
    return d.kind == "method" and (d.name.startswith(FRAMEWORK_PREFIXES)
                                   or d.name in FRAMEWORK_NAMES
                                   or bool(REGISTERING_DECORATORS & set(d.decorators)))


def _alive(d: Definition, uses, dead: list[Definition]) -> bool:
    """Used somewhere outside its own body and outside every definition found dead."""
    return any(not d.encloses(path, line) and not any(x.encloses(path, line) for x in dead)
               for path, line in uses.get(d.name, ()))


def find_dead(root: pathlib.Path, packages, keep=lambda d: False) -> list[Definition]:
    """Public definitions in `packages` (folders under `root`) with no reference from the
    Python files under `root` outside `tests/`, other than from their own bodies or from
    other dead definitions. Those `keep(definition)` accepts count as alive without one."""
    sources = non_test_sources(root)
    trees = {p: parse(p) for p in sources}
    for package in packages:
        for p in (root / package).rglob("*.py"):
            if p not in trees:
                trees[p] = parse(p)
    defs = [d for package in packages for p in sorted((root / package).rglob("*.py"))
            for d in definitions(p, trees[p])]
    # Name -> the places it is used.
    uses: dict[str, list[tuple[pathlib.Path, int]]] = {}
    for path in sources:
        for name, line in references(path, trees[path]):
            uses.setdefault(name, []).append((path, line))
    for name in entry_points(root / "pyproject.toml"):
        uses.setdefault(name, []).append((root / "pyproject.toml", 0))

    candidates = [d for d in defs if not keep(d) and not _is_framework_hook(d)]
    dead: list[Definition] = []
    while True:  # a fixpoint: what only dead code uses is dead too
        now = [d for d in candidates if not _alive(d, uses, dead)]
        if len(now) == len(dead):
            break
        dead = now
    # A method of a dead class is reported through its class.
    classes = [c for c in dead if c.kind == "class"]
    return [d for d in dead if not any(c is not d and c.encloses(d.path, d.first) for c in classes)]
