"""The option groups several `ember` subcommands share (model, engine, split, speculation,
chat format, sampling), each added to a parser by one function.

Only argparse and plain modules are imported: every flag's choices and defaults are defined
there, and `ember --help` must answer without importing torch.
"""

from __future__ import annotations

import argparse

from ember.models.chat_format import CHAT_FORMATS
from ember.offload.options import choices
from ember.offload.options.sampling import SamplingParams

SAMPLING = SamplingParams()  # the defaults of the sampling flags


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="MODEL",
                   help="GGUF file, Hugging Face folder, or a name `ember models` lists (an "
                        "Ollama name:tag, a Hugging Face org/repo, a catalog name such as "
                        "qwen2.5-coder-0.5b-instruct) (default: the embedded Gemma 3 270M)")


def add_split_options(p: argparse.ArgumentParser) -> None:
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


def add_gpu_option(p: argparse.ArgumentParser) -> None:
    from ember.offload.hybrid.gpu_cards import CARDS  # a plain table: no torch behind it

    p.add_argument("--gpu", choices=tuple(CARDS), metavar="NAME",
                   help="the card a --gpu-budget plan is priced for: "
                        f"{', '.join(CARDS)} (default: this machine's CUDA device, else "
                        "the table's first card with the budget's memory)")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
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
                   help="KV cache values: f16 (default), q8_0 (blocks of 32 int8 and a "
                        "scale: 0.53x the memory and bytes read) or bf16 (f16's bytes; "
                        "attention by AVX512_BF16 dot products where the CPU has them); "
                        "costs and speeds in docs/long-context.md")
    add_split_options(p)
    add_gpu_option(p)
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


def add_speculation_options(p: argparse.ArgumentParser) -> None:
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


def add_chat_format_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-format", default="auto", choices=CHAT_FORMATS,
                   help="how a conversation is written for the model: auto (the file's chat "
                        "template, else a plain User:/Assistant: transcript that base models "
                        "follow), template, transcript, or a family's instruction format")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
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
