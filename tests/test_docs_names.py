"""The docs name only files and functions that exist: every `path/to/file.py` and
`module.name` in backticks in README.md, DEVELOPERS.md, ARCHITECTURE.md, every page of docs/
and the code's docstrings (`doc_names` says which spans count as names), and every relative
Markdown link between them points at a file."""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest

from .doc_names import build_index, docstrings, missing

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "DEVELOPERS.md", "ARCHITECTURE.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
README_MAX_LINES = 300  # a user's guide; internals and measurements live in docs/
# [text](target): a Markdown link; targets with a scheme (https:) or only an #anchor are not files
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
PACKAGES = ("app", "offload", "predictors", "placement", "kernels", "models", "bench")

# Dotted spans that are not Python: keys of model files and fields of JSON replies.
NOT_PYTHON = {
    "tokenizer.ggml.pre": "a GGUF metadata key",
    "tokenizer.chat_template": "a GGUF metadata key",
    "phi3.attention.sliding_window": "a GGUF metadata key",
    "hybrid.gpu_ffn_formats": "a field of `generate --json`",
    "hybrid.layer_timing_ms": "a field of `generate --json`",
    "stream_options.include_usage": "a field of the OpenAI chat API",
    "prompt_tokens_details.cached_tokens": "a field of the OpenAI chat API",
}


@pytest.fixture(scope="module")
def index():
    return build_index(ROOT)


@pytest.mark.parametrize("doc", DOCS)
def test_the_developer_docs_name_files_and_functions_that_exist(index, doc):
    gone = [span for span in missing(index, (ROOT / doc).read_text()) if span not in NOT_PYTHON]
    assert not gone, f"{doc} names what does not exist: {gone}"


def test_docs_has_pages_and_the_readme_links_each_of_them():
    pages = [doc for doc in DOCS if doc.startswith("docs/")]
    readme = (ROOT / "README.md").read_text()
    assert pages, "docs/ has no pages"
    unlinked = [page for page in pages if f"]({page})" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_point_at_files(doc):
    path = ROOT / doc
    targets = [t.split("#")[0] for t in LINK.findall(path.read_text())
               if ":" not in t and not t.startswith("#")]
    broken = [t for t in targets if not (path.parent / t).exists()]
    assert not broken, f"{doc} links to what does not exist: {broken}"


def test_the_readme_is_a_users_guide_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines: move internals and measurements to docs/")


def test_docstrings_name_files_and_functions_that_exist(index):
    gone = [f"{path.relative_to(ROOT)}:{line}: `{span}`"
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for line, text in docstrings(path)
            for span in missing(index, text) if span not in NOT_PYTHON]
    assert not gone, "docstrings name what does not exist:\n" + "\n".join(gone)


def test_the_checker_finds_names_that_are_gone(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/engine.py": """
            import torch

            LIMIT = 3

            class Engine:
                def __init__(self):
                    self.kv = None

                def stream(self):
                    pass

            class Layer(torch.nn.Module):
                pass
        """,
        "pkg/csrc/select.cpp": "struct Selector { void pick(); };",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    index = build_index(tmp_path)
    present = ("`pkg/engine.py` `engine.py` `csrc/select.cpp` `pkg/` `engine.Engine` "
               "`engine.LIMIT` `Engine.stream` `Engine.kv` `Engine.stream()` "
               "`pkg.engine.Engine.stream` `ember.pkg.engine` `Layer.to(device)` "
               "`pkg/engine.py:Engine.stream` `engine.py:LIMIT` `pkg/engine.py:Layer.to` "
               "`csrc/select.cpp:Selector::pick` "
               "`torch.float16` `config.json` `ember chat`")
    assert missing(index, present) == []
    gone = ("`pkg/runner.py` `runner.py` `csrc/gone.cpp` `engine.steps` `Engine.steps` "
            "`pkg.engine.Runner` `pkg.runner` `kv_blocks.blocks_for_budget` "
            "`pkg/engine.py:Engine.steps` `pkg/engine.py:Runner` `pkg/runner.py:Runner` "
            "`csrc/select.cpp:Selector::drop`")
    assert missing(index, gone) == ["pkg/runner.py", "runner.py", "csrc/gone.cpp", "engine.steps",
                                    "Engine.steps", "pkg.engine.Runner", "pkg.runner",
                                    "kv_blocks.blocks_for_budget", "pkg/engine.py:Engine.steps",
                                    "pkg/engine.py:Runner", "pkg/runner.py:Runner",
                                    "csrc/select.cpp:Selector::drop"]
