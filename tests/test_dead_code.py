"""No dead code: every public function, method and class has a caller outside tests/.

`dead_code.find_dead` does the looking (by name, with `ast`; see its docstring for what counts
as a use). What it may not find a caller for is listed here, each with its reason.
"""

from __future__ import annotations

import pathlib
import textwrap

from .dead_code import find_dead

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("app", "offload", "predictors", "placement", "kernels", "models", "bench")

# Kept without a caller, on purpose.
ALLOWED = {
    "models/testing/synthetic.py::write_hf":
        "writes the Hugging Face folders the safetensors loader is tested on; it shares "
        "synthetic.py's tensor naming, and STYLE.md keeps the tiny synthetic models in models/",
    "models/testing/synthetic.py::confident_weights":
        "makes the family tests' tiny models confident (logits several units apart at the top) "
        "so argmax can be compared with llama.cpp at every position; beside tiny_weights, "
        "where STYLE.md keeps the tiny synthetic models",
    "offload/kv/paged.py::PagedKVCache.fork":
        "a KV verb STYLE.md names (fork with copy-on-write); the property test against a "
        "contiguous cache exercises it, nothing in the runtime shares a prefix yet",
}


def is_kernel_reference(d) -> bool:
    """A kernel's plain reference is its test oracle (STYLE.md: every kernel has one), so a
    reference that only tests call is kept (named `op_reference`: kernels/__init__.py)."""
    return d.path.parent.name == "kernels" and d.name.endswith("_reference")


def keep(d) -> bool:
    key = d.key(ROOT)
    return key in ALLOWED or is_kernel_reference(d)


def test_every_public_function_has_a_caller_outside_tests():
    dead = find_dead(ROOT, PACKAGES, keep)
    assert not dead, (
        "no caller outside tests/ (delete it, or add it to ALLOWED with the reason):\n"
        + "\n".join(d.where(ROOT) for d in dead))


def test_allow_lists_name_only_definitions_that_would_be_dead():
    # An entry whose function was deleted, renamed or gained a caller is stale.
    listed = set(ALLOWED)
    dead = {d.key(ROOT) for d in find_dead(ROOT, PACKAGES, lambda d: False)}
    stale = sorted(listed - dead)
    assert not stale, "stale allow-list entries (remove them):\n" + "\n".join(stale)


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_checker_reports_a_new_dead_function_and_nothing_alive(tmp_path):
    root = _tree(tmp_path, {
        "pyproject.toml": '[project.scripts]\ntool = "pkg.cli:main"\n',
        "pkg/__init__.py": '__all__ = ["exported_only"]\n',
        "pkg/cli.py": """
            from .core import Screen, used

            def main():
                used()
                return Screen()
        """,
        "pkg/core.py": """
            def used():
                return Helper().step()

            def dead():
                return dead() + only_from_dead()

            def only_from_dead():
                return 1

            def exported_only():
                pass

            def by_string():
                pass

            def tested_only():
                pass

            LOOKUP = {"key": "by_string"}

            class Helper:
                def step(self):
                    return 0

                def unused_method(self):
                    pass

            class Screen:
                BINDINGS = [("q", "app.leave", "Leave")]

                def on_mount(self):
                    pass

                @on(Button.Pressed, "#ok")
                def pressed(self, event):
                    pass

                def action_leave(self):
                    pass

                def action_never_bound(self):
                    pass

            class DeadClass:
                def method_of_a_dead_class(self):
                    pass
        """,
        "tests/test_core.py": """
            from pkg.core import tested_only, dead, DeadClass

            def test_it():
                tested_only()
                dead()
                DeadClass().method_of_a_dead_class()
        """,
    })
    found = {d.qualname for d in find_dead(root, ["pkg"])}
    assert found == {"dead", "only_from_dead", "exported_only", "tested_only",
                     "Helper.unused_method", "Screen.action_never_bound", "DeadClass"}
    # Kept by name, it no longer counts as dead, nor does what only it calls.
    found = {d.qualname for d in find_dead(root, ["pkg"], lambda d: d.qualname == "dead")}
    assert "dead" not in found and "only_from_dead" not in found
