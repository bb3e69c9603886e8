"""The import graph points one way: app -> offload -> predictors/placement/kernels -> models."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANK = {"models": 0, "kernels": 1, "placement": 1, "predictors": 1, "offload": 2, "app": 3}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_no_upward_imports():
    bad = []
    for pkg, rank in RANK.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for name in _imports(f):
                parts = name.split(".")
                if parts[0] == "ember" and len(parts) > 1:
                    target = parts[1]
                elif parts[0] in RANK:
                    bad.append(f"{f}: imports {name} without the ember namespace")
                    continue
                else:
                    continue
                if RANK.get(target, -1) > rank:
                    bad.append(f"{f.relative_to(ROOT)}: imports {name}")
    assert not bad, "\n".join(bad)
