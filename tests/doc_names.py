"""Check that the file paths and `module.name` references in backticks still exist.

Read with `ast` and the file system only. A span is checked when it looks like a project
file (`offload/kv/paged.py`, `csrc/select.cpp`, `engine.py`), a file and a name in it
(`offload/kv/paged.py:PagedKVCache.fork`, `csrc/decoder_step.cpp:DecoderStep::run`, as
ARCHITECTURE.md and docs/ cite them) or a dotted name whose first part is a project package,
module or class (`offload.kv.paged.PagedKVCache`, `paged.PagedKVCache.fork`, `Engine.stream`);
anything else in backticks (`torch.float16`, `ember chat`, a flag) is prose.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from dataclasses import dataclass, field

SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".sh", ".md", ".toml")
# Files of other kinds: `config.json` is a file name, not the attribute `json` of `config`.
DATA_SUFFIXES = (".json", ".jsonl", ".gguf", ".safetensors", ".txt", ".bin", ".yaml", ".yml",
                 ".csv", ".log", ".svg", ".png", ".jinja",
                 ".weight", ".bias")  # and tensor names: `attn_q.bias`
# Bases whose members a class does not inherit anything unknown from.
PLAIN_BASES = {"object", "Protocol", "ABC", "Generic"}
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")
# `path/to/file.py:Class.method`, `file.cpp:Type::name`
CITATION = re.compile(r"^((?:[\w-]+/)*[\w-]+\.(?:py|cpp|h)):([\w.:]+)$")


@dataclass
class Index:
    """What exists: every project file, each module's top-level names, each class's members."""

    root: pathlib.Path
    files: set[str] = field(default_factory=set)  # posix paths relative to root
    modules: dict[str, list[set[str]]] = field(default_factory=dict)  # stem -> names, per module
    # ("offload", "kv", "paged") -> its top-level names
    by_path: dict[tuple[str, ...], set[str]] = field(default_factory=dict)
    classes: dict[str, list[ast.ClassDef]] = field(default_factory=dict)

    def members(self, class_name: str, seen=()) -> set[str] | None:
        """Methods, class attributes, fields and `self.x` attributes, bases' included; None
        when a base is not ours (`nn.Module`, `Exception`): its members are not known here."""
        out: set[str] = set()
        for node in self.classes.get(class_name, ()):
            for child in ast.walk(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(child.name)
                elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    out.add(child.id)
                elif isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store):
                    out.add(child.attr)
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in PLAIN_BASES or name in seen:
                    continue
                inherited = None
                if name in self.classes:
                    inherited = self.members(name, (*seen, class_name))
                if inherited is None:
                    return None
                out |= inherited
        return out


def parse(path: pathlib.Path) -> ast.Module:
    """The file's syntax tree, parsed once per version of the file."""
    return _parse(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _parse(path: pathlib.Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names


def build_index(root: pathlib.Path) -> Index:
    index = Index(root)
    for top in root.iterdir():
        if top.name.startswith((".", "build")):
            continue
        if top.is_file():
            index.files.add(top.name)
            continue
        for p in top.rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                index.files.add(p.relative_to(root).as_posix())
    for rel in sorted(f for f in index.files if f.endswith(".py")):
        tree = parse(root / rel)
        names = _top_level_names(tree)
        parts = tuple(rel[:-3].split("/"))
        if parts[-1] == "__init__":
            parts = parts[:-1]
            names |= {p.split("/")[-1].removesuffix(".py") for p in index.files
                      if p.startswith("/".join(parts) + "/") and p.count("/") == len(parts)}
        index.by_path[parts] = names
        if parts:
            index.modules.setdefault(parts[-1], []).append(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                index.classes.setdefault(node.name, []).append(node)
    return index


def spans(text: str) -> list[str]:
    return [s.strip() for s in SPAN.findall(text)]


def _path_exists(index: Index, span: str) -> bool | None:
    """True/False for a span that names a project file or folder; None for other spans."""
    if not PATH.match(span) or span.startswith("."):
        return None
    folder = span.endswith("/")
    if not folder and not span.endswith(SOURCE_SUFFIXES):
        return None
    if "/" not in span.rstrip("/") and not folder and not span.endswith((".py", ".cpp", ".h")):
        return None  # a bare README.md or pyproject.toml is a file of some other project too
    needle = span.rstrip("/")
    if folder:
        return any(f.startswith(needle + "/") or ("/" + needle + "/") in f for f in index.files)
    return any(f == needle or f.endswith("/" + needle) for f in index.files)


def _attribute_exists(index: Index, owner_names: list[set[str]], rest: list[str]) -> bool:
    """Does `rest[0]` exist in one of these namespaces, and `rest[1:]` as class members?"""
    if not any(rest[0] in names for names in owner_names):
        return False
    for a, b in zip(rest, rest[1:]):
        members = index.members(a) if a in index.classes else None
        if members is None:
            return True  # not one of our classes, or one with a foreign base: not ours to check
        if b not in members:
            return False
    return True


def _dotted_exists(index: Index, span: str) -> bool | None:
    """True/False for a dotted name whose head is a project package, module or class."""
    match = DOTTED.match(span)
    if not match:
        return None
    parts = match.group(1).split(".")
    if parts[0] == "ember":
        parts = parts[1:]
    if not parts or span.endswith(SOURCE_SUFFIXES + DATA_SUFFIXES):
        return None
    if (parts[0],) in index.by_path:  # a package: ember.offload.kv.paged.PagedKVCache
        i = 1
        while i < len(parts) and tuple(parts[: i + 1]) in index.by_path:
            i += 1
        if tuple(parts[:i]) not in index.by_path:
            return False
        module = index.by_path[tuple(parts[:i])]
        return i == len(parts) or _attribute_exists(index, [module], parts[i:])
    if parts[0] in index.modules and parts[0] not in index.classes:
        return _attribute_exists(index, index.modules[parts[0]], parts[1:])
    if parts[0] in index.classes:
        members = index.members(parts[0])
        return None if members is None else _attribute_exists(index, [members], parts[1:])
    # A snake_case head reads as one of our modules (`kv_blocks.blocks_for_budget`): one that
    # is gone. Third-party heads (`torch.float16`, `np.int8`) and variables (`args.kv_budget`)
    # carry no underscore.
    return False if "_" in parts[0].strip("_") else None


def _citation_exists(index: Index, span: str) -> bool | None:
    """True/False for `file.py:Name.member` (or `file.cpp:Type::name`): the file exists and
    defines the name (in C++: each `::` part appears as a word); None for other spans."""
    match = CITATION.match(span)
    if not match:
        return None
    path, name = match.groups()
    files = [f for f in index.files if f == path or f.endswith("/" + path)]
    if not files:
        return False
    if not path.endswith(".py"):
        texts = [(index.root / f).read_text() for f in files]
        return any(all(re.search(rf"\b{re.escape(part)}\b", text) for part in name.split("::"))
                   for text in texts)
    modules = [index.by_path.get(_module_parts(f), set()) for f in files]
    return _attribute_exists(index, modules, name.split("."))


def _module_parts(file: str) -> tuple[str, ...]:
    parts = tuple(file[:-3].split("/"))
    return parts[:-1] if parts[-1] == "__init__" else parts


def missing(index: Index, text: str) -> list[str]:
    """The spans of `text` that name a project file or name that does not exist."""
    out = []
    for span in spans(text):
        for check in (_citation_exists, _path_exists, _dotted_exists):
            verdict = check(index, span)
            if verdict is False:
                out.append(span)
            if verdict is not None:
                break
    return out


def docstrings(path: pathlib.Path):
    """(line, text) of the module, class and function docstrings of a Python file."""
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc
