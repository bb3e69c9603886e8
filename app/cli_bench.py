"""`ember bench ...`: the benchmarks' subcommands, each printing one JSON object."""

from __future__ import annotations

from ember.offload.options import choices

from .cli_options import add_engine_options, add_gpu_option, add_model_options


def _prints_json(b, handler: str) -> None:
    """Every benchmark prints one JSON object (with --json, nothing else) and runs `handler`
    (a module of app/commands)."""
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler=handler)


def add_bench_parsers(sub) -> None:
    """`bench` and its benchmarks under the top-level subparsers `sub`."""
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bench.add_parser("decode", help="prefill and decode tokens/s (optionally vs llama.cpp)")
    add_engine_options(b)
    b.add_argument("--prompt-tokens", type=int, default=128, metavar="N")
    b.add_argument("--gen-tokens", type=int, default=64, metavar="N")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    b.add_argument("--against", choices=("llama.cpp",), help="also measure this engine, interleaved")
    b.add_argument("--speculate", dest="drafters", nargs="+", default=[], choices=("self", "lookup"),
                   metavar="DRAFTER", help="also measure Ember with these drafters (self, lookup)")
    b.add_argument("--text", default="repeated", choices=("repeated", "prose"),
                   help="prompt: a sentence repeated (default) or a paragraph of prose")
    _prints_json(b, "bench_decode")
    b = bench.add_parser("context", help="prefill and decode after long prompts of source code "
                                         "(optionally vs llama.cpp, flash attention off and on)")
    add_engine_options(b)
    b.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 1024, 3072, 6144, 12288],
                   metavar="N", help="prompt lengths (default: 128 1024 3072 6144 12288)")
    b.add_argument("--gen-tokens", type=int, default=64, metavar="N")
    b.add_argument("--runs", type=int, default=1, metavar="N")
    b.add_argument("--against", choices=("llama.cpp",),
                   help="also measure llama.cpp with flash attention off and on, interleaved")
    _prints_json(b, "bench_context")
    b = bench.add_parser("sparsity", help="decode tokens/s dense vs input-thresholded (GLU "
                                          "sparsity), interleaved, with the ideal from bytes")
    add_model_options(b)
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's choice)")
    b.add_argument("--sparsity", type=float, nargs="*", default=[0.4, 0.5], metavar="S",
                   help="target input sparsities, thresholds from a pass over the prompt "
                        "(default: 0.4 0.5)")
    b.add_argument("--profile", metavar="PATH", help="also the thresholds of this profile")
    b.add_argument("--prompt-tokens", type=int, default=64, metavar="N")
    b.add_argument("--gen-tokens", type=int, default=32, metavar="N")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    _prints_json(b, "bench_sparsity")
    b = bench.add_parser("speculate", help="plain decode vs each drafter on prose, code and "
                                           "repeat prompts: tokens/s, accepted length")
    add_engine_options(b)
    b.add_argument("--drafters", nargs="+", default=["self", "lookup"],
                   choices=("auto", "self", "lookup", "model"), metavar="NAME",
                   help="drafters to compare with plain decoding: auto, self, lookup, model "
                        "(default: self lookup)")
    b.add_argument("--draft-model", metavar="PATH", help="for the 'model' drafter")
    b.add_argument("--tree", metavar="SPEC", help="draft tree for every drafter")
    b.add_argument("--gen-tokens", type=int, default=64, metavar="N")
    b.add_argument("--prompts", type=int, metavar="N",
                   help="prompts per kind (default: 2; all those of --prompts-file)")
    b.add_argument("--prompts-file", metavar="PATH",
                   help="chat requests instead, one JSON object a line with a \"request\" "
                        "(e.g. bench/data/humaneval10_chat.jsonl)")
    b.add_argument("--runs", type=int, default=1, metavar="N",
                   help="runs of each prompt, engines interleaved (figures: medians)")
    _prints_json(b, "bench_speculate")
    b = bench.add_parser("kv", help="paged KV cache: swap-in vs re-prefill, paged vs contiguous decode")
    add_engine_options(b)
    b.add_argument("--resume-tokens", type=int, default=2000, metavar="N")
    b.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048], metavar="N")
    b.add_argument("--steps", type=int, default=32, metavar="N", help="decode steps per run")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    _prints_json(b, "bench_kv")
    b = bench.add_parser("kernels", help="sparse vs dense FFN kernel timings (7B and default shapes)")
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: 2)")
    b.add_argument("--reps", type=int, default=7, metavar="N", help="repetitions (median)")
    b.add_argument("--shape", choices=("llama-7b", "gemma3-270m"), help="only this shape")
    b.add_argument("--dtype", choices=("fp32", "int8"), help="only this weight type")
    _prints_json(b, "bench_kernels")
    b = bench.add_parser("placement", help="hot/cold placement: ILP vs greedy on a 70B-shaped "
                         "problem, or with --shape Ember's split vs whole-layer offload")
    b.add_argument("--shape", choices=("llama2-7b", "llama2-13b", "llama2-70b"),
                   help="forecast this paper shape: Ember's whole-model plan and llama.cpp's "
                        "whole-layer offload, predicted ms/token at --gpu-budget")
    b.add_argument("--quant", default="Q4_K_M", choices=("Q4_K_M", "Q4_0", "Q8_0", "F16"),
                   help="the file's quant mix (with --shape)")
    b.add_argument("--gpu-budget", metavar="SIZE", default="24GiB",
                   help="GPU memory for both plans (with --shape; default 24GiB)")
    b.add_argument("--ctx", type=int, default=choices.BENCH_CTX, metavar="N",
                   help="context the KV cache is sized for (with --shape)")
    add_gpu_option(b)
    b.add_argument("--dtype", choices=("int8", "fp16"), default="int8", help="FFN weight type")
    b.add_argument("--gpu-gib", type=float, default=24.0, metavar="GIB", help="GPU memory")
    b.add_argument("--group-size", type=int, metavar="N",
                   help="neurons per ILP group (default: sized for ~20k groups in all)")
    b.add_argument("--time-limit", type=float, default=8.0, metavar="S", help="ILP time limit")
    b.add_argument("--threads", type=int, metavar="N", help="CBC threads (default: CBC's choice)")
    b.add_argument("--seed", type=int, default=0, metavar="N")
    _prints_json(b, "bench_placement")
    b = bench.add_parser("startup", help="process start to first token and peak RSS of "
                                         "`ember generate`, beside `import torch` (and llama.cpp)")
    b.add_argument("model", nargs="?", metavar="MODEL",
                   help="GGUF file (default: the embedded Gemma 3 270M)")
    b.add_argument("--against", choices=("llama.cpp",), help="also measure this engine")
    b.add_argument("--threads", type=int, default=2, metavar="N", help="CPU threads (default: 2)")
    b.add_argument("--ctx-size", type=int, default=choices.BENCH_CTX, metavar="N",
                   help=f"context window for both engines (default: {choices.BENCH_CTX}, "
                        "capped at the model's)")
    b.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens to generate")
    b.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs of each command")
    _prints_json(b, "bench_startup")
