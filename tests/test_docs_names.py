"""The docs name only files and functions that exist: every `path/to/file.py` and
`module.name` in backticks in README.md, DEVELOPERS.md and the code's docstrings
(`doc_names` says which spans count as names)."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from .doc_names import build_index, docstrings, missing

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "DEVELOPERS.md")
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
        "pkg/csrc/select.cpp": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    index = build_index(tmp_path)
    present = ("`pkg/engine.py` `engine.py` `csrc/select.cpp` `pkg/` `engine.Engine` "
               "`engine.LIMIT` `Engine.stream` `Engine.kv` `Engine.stream()` "
               "`pkg.engine.Engine.stream` `ember.pkg.engine` `Layer.to(device)` "
               "`torch.float16` `config.json` `ember chat`")
    assert missing(index, present) == []
    gone = ("`pkg/runner.py` `runner.py` `csrc/gone.cpp` `engine.steps` `Engine.steps` "
            "`pkg.engine.Runner` `pkg.runner` `kv_blocks.blocks_for_budget`")
    assert missing(index, gone) == ["pkg/runner.py", "runner.py", "csrc/gone.cpp", "engine.steps",
                                    "Engine.steps", "pkg.engine.Runner", "pkg.runner",
                                    "kv_blocks.blocks_for_budget"]
