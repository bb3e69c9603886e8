#!/usr/bin/env bash
# Builds bench/attention_ab.cpp with the attention kernel from two source trees and runs it:
#   bench/attention_ab.sh A_CSRC B_CSRC KEYS LAYERS ROUNDS
# e.g. a copy of kernels/csrc from before a change against the working tree, the 1.5B's shape
# at 6k: bench/attention_ab.sh /tmp/csrc_before kernels/csrc 6144 28 60
# (SHAPE=32,32,128 for Llama 2 7B's; KV=q8_0 or bf16 for those pools; the driver builds against
# A's headers, so a tree from before bfloat16 pools (2026-12-04) goes as B). AVX-512 machines; flags as
# kernels/cpu_extension.py's AVX-512 build, or with BUILD=v3 its AVX2 build's (where the kernel
# runs the AVX2 path).
# One run's ratio moves by a few percent on this host: a tree against itself read 0.998-1.029,
# so an effect under ~3% needs several runs, in both orders (A B, then B A).
set -euo pipefail
if [ $# -ne 5 ]; then
    echo "usage: $0 A_CSRC B_CSRC KEYS LAYERS ROUNDS" >&2
    exit 2
fi
a=$(realpath "$1") b=$(realpath "$2")
shift 2
here=$(cd "$(dirname "$0")" && pwd)
py="$here/../.venv/bin/python"
torch=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
abi=$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# BUILD=v3: the AVX2 build's flags (16 vector registers, as an AVX2-only CPU runs it)
march=(-march=x86-64-v4 -mavx512vnni -mprefer-vector-width=256)
[ "${BUILD:-}" = v3 ] && march=(-march=x86-64-v3)
flags=(-O3 -fopenmp -ffp-contract=fast -Wno-c++20-extensions "${march[@]}"
       -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$torch/include"
       -I"$torch/include/torch/csrc/api/include")
b_flags=(-Dember_attention=ember_attention_B)
pids=()
g++ "${flags[@]}" -I"$a" -c "$a/attention.cpp" -o "$out/a.o" & pids+=($!)
g++ "${flags[@]}" "${b_flags[@]}" -I"$b" -c "$b/attention.cpp" -o "$out/b.o" & pids+=($!)
g++ "${flags[@]}" -I"$a" -c "$here/attention_ab_entry.cpp" -o "$out/entry_a.o" & pids+=($!)
g++ "${flags[@]}" "${b_flags[@]}" -DENTRY_B -I"$b" -c "$here/attention_ab_entry.cpp" -o "$out/entry_b.o" & pids+=($!)
g++ "${flags[@]}" -I"$a" -c "$here/attention_ab.cpp" -o "$out/main.o" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
g++ -fopenmp "$out"/*.o -L"$torch/lib" -ltorch_cpu -lc10 -Wl,-rpath,"$torch/lib" -o "$out/attention_ab"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$out/attention_ab" "$@"
