"""The import graph points one way: app -> offload -> predictors/placement/kernels -> models,
and inside offload/ from room to room in the order its package docstring lists."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANK = {"models": 0, "kernels": 1, "placement": 1, "predictors": 1, "offload": 2, "app": 3}
# What each room of offload/ may import from the others (its own modules always).
ROOMS = {
    "options": set(),
    "kv": {"options"},
    "body": {"options"},
    "hybrid": {"body", "kv", "options"},
    "decode": {"body", "kv", "options"},
    "speculative": {"decode", "body", "kv", "options"},
    "runtime": {"speculative", "decode", "hybrid", "body", "kv", "options"},
    "profile": {"runtime", "speculative", "decode", "hybrid", "body", "kv", "options"},
}


def _imports(path: pathlib.Path):
    """Absolute module names `path` imports; relative ones resolved against its package."""
    package = path.relative_to(ROOT).parent.parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module:
                    yield node.module
                continue
            base = ("ember", *package[: len(package) - node.level + 1])
            if node.module:
                yield ".".join((*base, node.module))
            else:  # from . import a, b
                yield from (".".join((*base, a.name)) for a in node.names)


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


def test_offload_rooms_import_only_the_rooms_below_them():
    bad = []
    for f in (ROOT / "offload").rglob("*.py"):
        room = f.relative_to(ROOT / "offload").parts[0]
        allowed = ROOMS.get(room)
        for name in _imports(f):
            parts = name.split(".")
            if parts[:2] != ["ember", "offload"] or len(parts) < 3:
                continue
            target = parts[2]
            if allowed is None:
                bad.append(f"{f.relative_to(ROOT)}: offload/ modules live in a room, not at its top")
            elif target != room and target not in allowed:
                bad.append(f"{f.relative_to(ROOT)} ({room}): imports {name}")
    assert not bad, "\n".join(bad)


def test_every_offload_module_sits_in_a_room_the_rules_name():
    rooms = {p.name for p in (ROOT / "offload").iterdir() if p.is_dir() and p.name != "__pycache__"}
    stray = [p.name for p in (ROOT / "offload").glob("*.py") if p.name != "__init__.py"]
    assert rooms == set(ROOMS), f"rooms on disk {sorted(rooms)} vs rules {sorted(ROOMS)}"
    assert not stray, f"modules outside any room: {stray}"


def test_each_room_says_what_it_owns_and_may_import():
    for room, allowed in ROOMS.items():
        doc = ast.get_docstring(ast.parse((ROOT / "offload" / room / "__init__.py").read_text()))
        assert doc, f"offload/{room}/__init__.py has no docstring"
        for other in allowed:
            assert f"`{other}`" in doc or "every" in doc, f"offload/{room} docstring omits `{other}`"


def test_every_package_on_disk_is_listed_for_installation():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for top in RANK:
        for init in (ROOT / top).rglob("__init__.py"):
            on_disk.add(".".join(("ember", *init.parent.relative_to(ROOT).parts)))
    assert on_disk <= listed, f"not installed by a non-editable install: {sorted(on_disk - listed)}"


# The Engine's internals: its runner (sessions, prefill, decode) and its paged KV cache.
ENGINE_INTERNALS = {"runner", "kv"}


def test_the_app_uses_only_the_engines_public_surface():
    """app/ reaches an engine through its methods (conversations, prompt checks, stats), never
    through its runner or KV cache: any attribute of those names is a reach past it."""
    bad = []
    for f in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not bad, "\n".join(bad)


def test_the_ground_floor_imports_nothing_else_of_ember():
    """models/support/ is what every room stands on: it may not reach back into them."""
    bad = [f"{f.relative_to(ROOT)}: imports {name}"
           for f in (ROOT / "models" / "support").rglob("*.py") for name in _imports(f)
           if name.startswith("ember.") and not name.startswith("ember.models.support")]
    assert not bad, "\n".join(bad)


def test_synthetic_models_are_for_tests_and_benches_only():
    """models/testing/ builds random-weight models: nothing the app runs may import it."""
    bad = [f"{f.relative_to(ROOT)}: imports {name}"
           for pkg in RANK for f in (ROOT / pkg).rglob("*.py")
           if "testing" not in f.relative_to(ROOT).parts
           for name in _imports(f) if name.startswith("ember.models.testing")]
    assert not bad, "\n".join(bad)
