#!/usr/bin/env bash
# The GPU tier's checks on a CUDA machine, in one go (issues 17 and 30); prints one JSON summary.
#
#   bench/gpu_check.sh [OUT_DIR]          (from the repo root; OUT_DIR defaults to $OUT or
#                                          /tmp/gpu_check; logs and summary.json go there)
#
# Made for a lent machine that has CUDA PyTorch and nothing to download from: the pure-Python
# and abi3 packages Ember needs that such an image may lack travel as wheels in .whl/ (made
# here beforehand, and carried: the folder is git-ignored; docs/gpu-tier.md, "Checks for a
# lent GPU"). A wheel is installed only where its module does not import already:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#       gguf pulp psutil safetensors tokenizers llguidance ninja
# A llama-cpp-python wheel built with CUDA may be carried there too; without one (or with a
# CPU-only one) the llama.cpp side of each budget is skipped or runs on the CPU, and the
# summary says which ("llama_cpp"). No model travels (the default model is 253 MB): a
# random-weight TinyLlama-1.1B-shaped Q4_K_M file is written on the spot by bench.make_model
# (real shape, real types), and a Llama-2-7B-shaped one of random codes (seconds).
#
# Steps: install (wheels, then Ember editable, no index), build the C++ kernels, the tests
# marked `cuda` (tests/test_cuda_tier.py) plus the tier tests (the file's blocks decoded on
# the GPU by the fused Triton kernel and by torch ops, int8/int4 attention and LM head, three
# budgets each, a verified tree's rows against plain decode's bit for bit, a decoded token
# replayed from its CUDA graph against the layers launched one by one, bit for bit), the
# fused kernel's GB/s per matrix shape (bench/tier_kernel_speed.py), `bench decode` on CUDA
# at three GPU budgets (256 MiB, 512 MiB, 1 GiB: the last holds the whole 1.1B model, its KV
# and head), each against llama.cpp `-ngl` at the layers the same budget holds, once with the
# self drafter (its tokens must equal plain decoding's), once without CUDA graphs
# (EMBER_CUDA_GRAPHS=0: every kernel launched from Python), once after a 1,024-token prompt,
# and on the CPU without a split; the 7B at 8 GiB (all of it) and 3 GiB; a profile of a
# prompt and of decoded tokens with the whole 1.1B on the tier (bench/tier_profile.py); then
# one JSON line: what passed, tokens/s per run, the plan's per-layer modes and bytes, where
# attention ran and in what format, per-layer hot/cold/wait means.
# Every step after the install runs under one deadline (DEADLINE_S, 360 s from the start), so
# the summary prints within about 6 minutes; a step cut short reads as rc 124 in its log and the
# summary ("timed_out").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
PY=${PYTHON:-python3}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ember-ext} PYTHONUNBUFFERED=1
start=$(date +%s)
deadline=$(( start + ${DEADLINE_S:-360} ))
step() { echo "gpu_check: $1 ($(( $(date +%s) - start )) s)" >&2; }
timed_out=()
within() {  # NAME CAP COMMAND...: COMMAND for at most CAP s and what is left before the deadline
    local name=$1 cap=$2 left=$(( deadline - $(date +%s) )); shift 2
    (( left < cap )) || left=$cap
    (( left > 5 )) || left=5
    timeout "$left" "$@"
    local rc=$?
    (( rc == 124 )) && timed_out+=("$name")
    return $rc
}

step "install"
missing=()
for wheel in .whl/*.whl; do
    [ -f "$wheel" ] || continue
    module=$(basename "$wheel"); module=${module%%-*}; module=${module,,}
    $PY -c "import $module" 2>/dev/null || missing+=("$wheel")
done
if (( ${#missing[@]} )); then
    echo "gpu_check: installing ${missing[*]}" >&2
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ember-site "${missing[@]}" || exit 1
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
within kernels 150 $PY -c \
    "from ember.offload.body import file_blocks_model; assert file_blocks_model.applies()" \
    >"$out/kernels.log" 2>&1 || { tail -20 "$out/kernels.log" >&2; exit 1; }

step "tests"
within tests 100 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_tier.py tests/test_tier_weights.py \
    tests/test_tier_blocks_triton.py tests/test_tier_layer_triton.py \
    tests/test_tier_attention.py tests/test_tier_blocks.py tests/test_tier_placement.py \
    -k "not default_model" --junitxml="$out/tests.xml" >"$out/tests.log" 2>&1
tests_rc=$?

step "kernel speed"
# the fused block kernel's GB/s of the file's bytes at the default tile (bench/tier_kernel_speed.py)
within kernel_speed 40 $PY -m bench.tier_kernel_speed >"$out/kernel_speed.json" 2>"$out/kernel_speed.log"
# and at 1-32 rows of x, against the prompt path (where a short prompt should switch)
within kernel_rows 40 $PY -m bench.tier_kernel_speed --rows >"$out/kernel_rows.json" \
    2>"$out/kernel_rows.log"
# llama.cpp beside each budget where this image has it (a CUDA build offloads -ngl layers)
against=()
if $PY -c "import llama_cpp" 2>/dev/null; then against=(--against llama.cpp); fi

step "model"
# waited for until a minute before the deadline, then given up (the summary says so)
while [ -n "$maker" ] && kill -0 "$maker" 2>/dev/null && (( $(date +%s) < deadline - 60 )); do
    sleep 2
done
if [ -n "$maker" ] && kill -0 "$maker" 2>/dev/null; then
    kill "$maker"; timed_out+=(make_model)
fi
if [ -n "$maker" ] && ! wait "$maker"; then tail "$out/make_model.log" >&2; fi

bench() {  # NAME, then bench decode's options
    local name=$1; shift
    step "bench decode $name"
    within "bench_$name" 40 $PY -m ember.app.cli bench decode --model "$model" --prompt-tokens 64 --gen-tokens 32 \
        --runs 2 --profile none --json "$@" >"$out/bench_$name.json" 2>"$out/bench_$name.log"
}
if [ -f "$model" ]; then
    for budget in 256MiB 512MiB 1GiB; do
        bench "cuda_$budget" --device cuda --gpu-budget "$budget" "${against[@]}"
    done
    bench cuda_512MiB_self --device cuda --gpu-budget 512MiB --speculate self
    EMBER_CUDA_GRAPHS=0 bench cuda_1GiB_eager --device cuda --gpu-budget 1GiB
    bench cuda_1GiB_1k --device cuda --gpu-budget 1GiB --prompt-tokens 1024  # a long context
    bench cpu_dense --device cpu
    step "7B"
    # the 7B shape of the GPU plan's headline case, random codes (seconds, not a quantizer's
    # minutes): the whole model on an 8 GiB budget, and half of it on 3 GiB (the rest on the
    # host's cores)
    model7=/tmp/ember-gpu-check-7b-q4_k_m.gguf
    [ -f "$model7" ] || within make_7b 60 $PY -m bench.make_model llama2-7b "$model7" \
        --quantizer random >"$out/make_7b.log" 2>&1
    if [ -f "$model7" ]; then
        bench 7b_8GiB --model "$model7" --device cuda --gpu-budget 8GiB
        bench 7b_3GiB --model "$model7" --device cuda --gpu-budget 3GiB
    fi
    step "profile"
    # where a decoded token's time goes with the whole model on the tier (bench/tier_profile.py)
    within profile 60 $PY -m bench.tier_profile "$model" --gpu-budget 1GiB --prompt-tokens 512 \
        >"$out/profile.json" 2>"$out/profile.log"
fi

step "summary"
$PY - "$out" "$tests_rc" "$(( $(date +%s) - start ))" "${timed_out[*]:-}" <<'PY' \
    | tee "$out/summary.json"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, tests_rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
timed_out = sys.argv[4].split()
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
                   layer_modes=h.get("layer_modes"),
                   attention_on_gpu=h["on_gpu_tier"]["attention_and_kv"],
                   lm_head_on_gpu=h["on_gpu_tier"]["lm_head"], charges=h["charges"],
                   attention_held=held, tier_kernels=h.get("tier_kernels"),
                   layer_ms={k: round(sum(t[k] for t in timing) / len(timing), 4)
                             for k in ("hot", "cold", "wait")} if timing else None)
    if "llama.cpp" in r:
        row["llama_cpp"] = {"decode_tok_s": r["llama.cpp"]["decode"]["median"],
                            "n_gpu_layers": r["llama.cpp"]["n_gpu_layers"],
                            "gpu_offload": r["llama.cpp"]["gpu_offload"],
                            "ember_over_llama_cpp": r["ratio_ember_over_llama_cpp"]["decode"]}
    if "ember+self" in r:  # speculation through the tier: tokens must equal plain decoding's
        row["self_identical_to_plain"] = r["ember+self"]["identical_to_plain"]
    runs[f.stem[6:]] = row
kernel = []
if (out / "kernel_speed.json").exists():
    for line in (out / "kernel_speed.json").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        kernel.append({"shape": r["shape"], "gbps": r["default_gbps"]})
rows = []
if (out / "kernel_rows.json").exists():
    for line in (out / "kernel_rows.json").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
profile = None
try:
    profile = json.loads((out / "profile.json").read_text().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    pass
try:
    import llama_cpp
    llama = {"installed": True,
             "gpu_offload": bool(getattr(llama_cpp, "llama_supports_gpu_offload", bool)())}
except ImportError:
    llama = {"installed": False, "gpu_offload": False,
             "note": "no llama-cpp-python on this image: carry a CUDA wheel in .whl/"}
print(json.dumps({"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
                  "tests_rc": tests_rc, "tests": tests, "llama_cpp": llama,
                  "fused_kernel_gbps": kernel, "rows_ms_fused_tiled": rows,
                  "bench_decode": runs, "profile": profile, "seconds": seconds,
                  "timed_out": timed_out}))
PY
