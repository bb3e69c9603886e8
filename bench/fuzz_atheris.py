"""Coverage-guided fuzzing of Ember's model readers with atheris (libFuzzer for Python).

    .venv/bin/pip install atheris
    .venv/bin/python -m bench.fuzz_atheris -max_total_time=600 -timeout=30 -rss_limit_mb=4096
    EMBER_FUZZ_TARGET=config .venv/bin/python -m bench.fuzz_atheris -max_total_time=600

Targets: `gguf` (default; the input is a whole GGUF file) or `config` (the input is the
config.json of an otherwise valid tiny Hugging Face folder). Each input is opened, loaded and
run one token; an EmberError is the expected refusal, any other exception is reported by
libFuzzer as a crash with the input saved as crash-<sha1>. The seed corpus is the tiny models
from `tests/fuzz_mutators.py`; extra libFuzzer arguments (corpus folders, -runs=N) pass through.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
import gguf  # noqa: F401  (third-party modules first, so only Ember's code is instrumented)
import safetensors  # noqa: F401
import tokenizers  # noqa: F401
import torch  # noqa: F401

with atheris.instrument_imports(include=["ember"]):
    from ember.models.support.errors import EmberError
    from tests.fuzz_harness import exercise

from tests.fuzz_mutators import build_seeds

TARGET = os.environ.get("EMBER_FUZZ_TARGET", "gguf")
WORK = Path(tempfile.mkdtemp(prefix="ember-atheris-"))


def _corpus() -> tuple[Path, Path]:
    """(seed corpus folder, HF folder whose config.json the `config` target replaces)."""
    (WORK / "seeds").mkdir()
    seeds = build_seeds(WORK / "seeds")
    corpus = WORK / "corpus"
    corpus.mkdir()
    for kind, path in seeds.items():
        src = path if path.is_file() else path / "config.json"
        if (TARGET == "gguf") == path.is_file():
            shutil.copyfile(src, corpus / kind)
    return corpus, seeds["hf-gemma3"]


def one_input(data: bytes) -> None:
    if TARGET == "gguf":
        path = WORK / "case.gguf"
        path.write_bytes(data)
    else:
        path = WORK / "case-hf"
        (path / "config.json").write_bytes(data)
    try:
        exercise(path)
    except EmberError:
        pass  # refused with a clear message: the outcome we want


def main() -> None:
    corpus, hf_seed = _corpus()
    if TARGET == "config":
        shutil.copytree(hf_seed, WORK / "case-hf")
    args = [sys.argv[0], *sys.argv[1:]]
    if not any(not a.startswith("-") for a in sys.argv[1:]):
        args.append(str(corpus))  # no corpus given: start from the tiny seed models
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
