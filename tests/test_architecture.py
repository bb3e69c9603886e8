"""ARCHITECTURE.md stays true: every file and `file:name` it cites exists, and the path of
one decoded token it writes out is at most 8 calls from the chat input to the matmul kernel."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"
# `path/to/file.py` or `path/to/file.py:Class.method` (C++: `file.cpp:Name` or `Type::name`)
CITE = re.compile(r"`((?:[\w-]+/)*[\w-]+\.(?:py|cpp|h|md|sh|toml))(?::([\w.:]+))?`")
MAX_TOKEN_PATH = 8


def _citations(text: str):
    return [(m.group(1), m.group(2)) for m in CITE.finditer(text)]


def _defines(path: pathlib.Path, qualified: str) -> bool:
    """Whether the Python file defines `qualified` (Function, Class, Class.method, or a
    module-level name); a C++ file, whether each `::`-separated part appears as a word."""
    text = path.read_text()
    if path.suffix != ".py":
        return all(re.search(rf"\b{re.escape(part)}\b", text) for part in qualified.split("::"))
    scope = ast.parse(text).body
    for part in qualified.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def _token_path(text: str) -> list[str]:
    """The numbered steps under the heading that names the path of one token."""
    section = re.search(r"^## The path of one token.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "ARCHITECTURE.md has no '## The path of one token' section"
    return re.findall(r"^\d+\.\s+(.*)$", section.group(1), re.M)


def test_every_file_and_name_cited_exists():
    missing = []
    for file, name in _citations(DOC.read_text()):
        path = ROOT / file
        if not path.is_file():
            missing.append(file)
        elif name and not _defines(path, name):
            missing.append(f"{file}:{name}")
    assert not missing, f"ARCHITECTURE.md cites what does not exist: {missing}"


def test_the_token_path_is_written_with_names_and_is_at_most_8_calls_deep():
    steps = _token_path(DOC.read_text())
    assert 3 <= len(steps) <= MAX_TOKEN_PATH, f"{len(steps)} calls on the token path"
    unnamed = [s for s in steps if not any(n for _, n in _citations(s))]
    assert not unnamed, f"steps without a `file:name`: {unnamed}"


def test_the_checker_catches_a_name_that_does_not_exist(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("class A:\n    def run(self):\n        pass\n\nLIMIT = 3\n")
    assert _defines(mod, "A.run") and _defines(mod, "LIMIT")
    assert not _defines(mod, "A.walk") and not _defines(mod, "B")
    cpp = tmp_path / "k.cpp"
    cpp.write_text("struct BodyStep { void run(); };")
    assert _defines(cpp, "BodyStep::run") and not _defines(cpp, "BodyStep::walk")
    assert _citations("see `a/b.py:A.run` and `c.cpp`") == [("a/b.py", "A.run"), ("c.cpp", None)]
