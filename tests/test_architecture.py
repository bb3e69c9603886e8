"""ARCHITECTURE.md stays true: every file and `file:name` it cites exists, and the path of
one decoded token it writes out is at most 8 calls from the chat input to the matmul kernel,
each step calling the next in the code itself (read with `ast`, and from the C++ sources)."""

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


def _path_citations(text: str) -> list[tuple[str, str]]:
    """The token path as `(file, name)` pairs, in order: the calls the section's opening
    paragraph names (from the chat input to the engine's stream), then the first citation of
    each numbered step."""
    section = re.search(r"^## The path of one token.*?$(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    opening = section.split("\n1. ", 1)[0]
    path = [(f, n) for f, n in _citations(opening) if n]
    for step in _token_path(text):
        path.append(next((f, n) for f, n in _citations(step) if n))
    return path


def _python_body(path: pathlib.Path, qualified: str) -> ast.AST:
    scope = ast.parse(path.read_text()).body
    node = None
    for part in qualified.split("."):
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                    and n.name == part)
        scope = node.body
    return node


def _python_calls(node: ast.AST) -> set[str]:
    """Names the function calls: `f(...)`, `x.f(...)`."""
    calls = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            calls.add(n.func.id if isinstance(n.func, ast.Name) else
                      getattr(n.func, "attr", None))
    return calls


def _cpp_body(path: pathlib.Path, qualified: str) -> str:
    """The braces-matched body of a C++ function defined as `Type::name(...) ... {`."""
    text = path.read_text()
    start = re.search(rf"\b{re.escape(qualified)}\s*\(", text).end()
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i: j + 1]
    raise AssertionError(f"unbalanced braces after {qualified}")


def _reaches(path: pathlib.Path, name: str, callee: str) -> bool:
    if path.suffix == ".py":
        return callee in _python_calls(_python_body(path, name))
    return re.search(rf"\b{re.escape(callee)}\s*\(", _cpp_body(path, name)) is not None


def _is_generator_over_its_input(path: pathlib.Path, name: str) -> bool:
    return path.suffix == ".py" and any(isinstance(n, (ast.Yield, ast.YieldFrom))
                                        for n in ast.walk(_python_body(path, name)))


def test_each_step_of_the_token_path_calls_the_next_in_the_code():
    """Read from the code, not the document's list: each step's function calls the next
    one's. A generator that only iterates what it was handed (the reply's events over the
    decode loop's tokens) is linked through the function that made both."""
    path = _path_citations(DOC.read_text())
    assert len(path) >= 6, path
    broken, maker = [], None
    for (file, name), (_, callee_name) in zip(path, path[1:]):
        callee = re.split(r"::|\.", callee_name)[-1]
        here = ROOT / file
        if _reaches(here, name, callee):
            maker = (here, name)
        elif maker and _is_generator_over_its_input(here, name) and _reaches(*maker, callee):
            pass  # the maker hands this generator the callee's own generator
        else:
            broken.append(f"{file}:{name} does not call {callee}")
    assert not broken, "\n".join(broken)


def test_the_checker_catches_a_name_that_does_not_exist(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("class A:\n    def run(self):\n        pass\n\nLIMIT = 3\n")
    assert _defines(mod, "A.run") and _defines(mod, "LIMIT")
    assert not _defines(mod, "A.walk") and not _defines(mod, "B")
    cpp = tmp_path / "k.cpp"
    cpp.write_text("struct BodyStep { void run(); };")
    assert _defines(cpp, "BodyStep::run") and not _defines(cpp, "BodyStep::walk")
    assert _citations("see `a/b.py:A.run` and `c.cpp`") == [("a/b.py", "A.run"), ("c.cpp", None)]
