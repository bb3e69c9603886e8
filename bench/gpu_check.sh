#!/usr/bin/env bash
# The GPU tier's checks on a CUDA machine, in one go (issue 17); prints one JSON summary.
#
#   bench/gpu_check.sh [OUT_DIR]          (from the repo root; OUT_DIR defaults to $OUT or
#                                          /tmp/gpu_check; logs and summary.json go there)
#
# Made for a lent machine that has CUDA PyTorch and nothing to download from: the only
# Python package Ember needs that such an image lacks is `gguf` (pure Python), carried as a
# wheel in .whl/ (made here beforehand, see README "GPU tier"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# No model travels (the default model is 253 MB): a random-weight TinyLlama-1.1B-shaped
# Q4_K_M file is written on the spot by bench.make_model (real shape, real types).
#
# Steps: install (wheels, then Ember editable, no index), build the C++ kernels, the tests
# marked `cuda` plus the tier-format and tier-attention tests (CPU ones too; not the one
# that needs the default model, which does not travel), `bench decode` on CUDA at three GPU
# budgets (at 1 GiB once more with attention kept on the host: --tier-attention auto moves
# attention and KV to the GPU there, a 1.1B model's 0.5 GiB of bf16 attention and KV not
# fitting 512 MiB) and on the CPU without a split, then one JSON line: what passed, tokens/s
# per run, the hot fraction, the tier formats and bytes, where attention ran and in what
# type, per-layer hot/cold/wait means. Aim: under 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
PY=${PYTHON:-python3}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ember-ext} PYTHONUNBUFFERED=1
start=$(date +%s)
step() { echo "gpu_check: $1 ($(( $(date +%s) - start )) s)" >&2; }

step "install"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ember-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/ember-site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { cat "$out/install.log" >&2; exit 1; }
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
    || exit 1

# The model is written while the kernels build and the tests run (its quantizer is the
# slowest step: 9 minutes on this project's shared 2-core machine, far less on 16 cores).
model=/tmp/ember-gpu-check-1.1b-q4_k_m.gguf
maker=""
if [ ! -f "$model" ]; then
    $PY -m bench.make_model tinyllama-1.1b "$model" --quant Q4_K_M --quantizer ember \
        >"$out/make_model.log" 2>&1 &
    maker=$!
fi

step "C++ kernels"
$PY -c "from ember.offload.body import quant_model; assert quant_model.applies()" \
    >"$out/kernels.log" 2>&1 || { tail -20 "$out/kernels.log" >&2; exit 1; }

step "tests"
$PY -m pytest -q -p no:cacheprovider tests/test_cuda_tier.py tests/test_tier_weights.py \
    tests/test_tier_attention.py -k "not default_model" \
    --junitxml="$out/tests.xml" >"$out/tests.log" 2>&1
tests_rc=$?

step "model"
if [ -n "$maker" ] && ! wait "$maker"; then tail "$out/make_model.log" >&2; exit 1; fi

bench() {  # NAME, then bench decode's options
    local name=$1; shift
    step "bench decode $name"
    $PY -m ember.app.cli bench decode --model "$model" --prompt-tokens 64 --gen-tokens 32 \
        --runs 2 --profile none --json "$@" >"$out/bench_$name.json" 2>"$out/bench_$name.log"
}
bench cpu_dense --device cpu
for budget in 256MiB 512MiB 1GiB; do
    bench "cuda_$budget" --device cuda --gpu-budget "$budget"
done
bench cuda_1GiB_attention_host --device cuda --gpu-budget 1GiB --tier-attention host

step "summary"
$PY - "$out" "$tests_rc" "$(( $(date +%s) - start ))" <<'PY' | tee "$out/summary.json"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, tests_rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
suite = ET.parse(out / "tests.xml").getroot().find("testsuite") if (out / "tests.xml").exists() else None
tests = None if suite is None else {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
runs = {}
for f in sorted(out.glob("bench_*.json")):
    try:
        r = json.loads(f.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        runs[f.stem[6:]] = {"error": (out / f"{f.stem}.log").read_text()[-400:]}
        continue
    e = r["ember"]
    row = {"decode_tok_s": e["decode"]["median"], "prefill_tok_s": e["prefill"]["median"]}
    h = e.get("hybrid")
    if h:
        timing = [t for t in h["layer_timing_ms"] if t]
        held = h.get("tier_attention_weights")
        row.update(hot_fraction=h["hot_fraction"], gpu_bytes=h["gpu_bytes"],
                   gpu_ffn_bytes=h["gpu_ffn_bytes"], formats=h["gpu_ffn_formats"],
                   attention_on_gpu=h["on_gpu_tier"]["attention_and_kv"],
                   attention_kv_charged={k: h["charges"][k] for k in ("attention", "kv_pool")},
                   attention_held=held,
                   layer_ms={k: round(sum(t[k] for t in timing) / len(timing), 4)
                             for k in ("hot", "cold", "wait")} if timing else None)
    runs[f.stem[6:]] = row
print(json.dumps({"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
                  "tests_rc": tests_rc, "tests": tests, "bench_decode": runs,
                  "seconds": seconds}))
PY
