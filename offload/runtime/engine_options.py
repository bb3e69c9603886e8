"""`EngineOptions`: every choice an engine is built with, checked when it is made (a
`ConfigError` naming the flag, never an assert)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.chat_format import CHAT_FORMATS
from ember.models.errors import ConfigError

from ..hybrid.memory_plan import SPLITS
from ..hybrid.tier_dtypes import ATTENTION_CHOICES, TIER_CHOICES
from ..kv.plan import DEFAULT_BLOCK_SIZE
from ..speculative.setup import SPECULATE_CHOICES
from ..speculative.token_tree import parse_tree

DEFAULT_CTX = 4096
FFN_MODES = ("auto", "dense", "sparse")
MMAP_CHOICES = ("auto", "on", "off")
# --kv-type: the KV cache's element type on the file-blocks runtime: float16, or Q8_0 blocks
# (34 bytes per 32 values: 0.53x the bytes, as llama.cpp's -ctk/-ctv q8_0).
KV_TYPES = ("f16", "q8_0")
# --weights: "auto" the file's own blocks (QuantModel) where the kernels are built, "fp32" the
# float32 reference (what perplexity comparisons are made against).
WEIGHT_CHOICES = ("auto", "fp32")
# Choices that once selected the requantized Q8_0 copies of the float32 model (issue 21).
REMOVED_WEIGHTS = {"q8": "removed: the default runtime (--weights auto) reads the file's own "
                         "blocks; --weights fp32 runs the float32 reference"}


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    n_ctx: int = DEFAULT_CTX  # capped at the model's own context length
    threads: int | None = None
    kv_budget: int | None = None  # device KV pool in bytes; None: one full-length context
    kv_host_budget: int | None = None  # host-RAM pool for swapped-out conversations
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    weights: str = "auto"  # WEIGHT_CHOICES: the file's own blocks, or the float32 reference
    # Hybrid FFN: a GPU-tier byte budget splits FFN layers into hot (GPU tier) and cold
    # (host) neurons; None with split "auto" runs the dense model on one device.
    gpu_budget: int | None = None
    split: str = "auto"  # "auto" | "cpu-only" | "gpu-only" (see memory_plan)
    cold_dtype: str = "auto"  # host-side FFN rows: "fp32", "int8", "auto" (int8 with a q8 body)
    # GPU-tier hot rows: "auto" (by file type and device: int4/int8/fp16, tier_dtypes.py) or
    # one format for every matrix ("int4", "int8", "fp16", "bf16", "fp32").
    tier_dtype: str = "auto"
    # Attention and its KV pool under --gpu-budget: "auto" (on a GPU tier in its 16-bit type
    # when the budget holds them, else on the host's file blocks), "host", or a type that
    # moves them on any device ("bf16", "fp16", "fp32"): tier_dtypes.attention_dtype.
    tier_attention: str = "auto"
    # A profile artifact (`ember profile`): its placement guides the split and its
    # predictors gate the cold side. ffn_mode "auto" runs sparse when a profile is given.
    profile: str | None = None  # a path, "auto" (this model's default profile if any) or None
    ffn_mode: str = "auto"  # "auto" | "dense" (every neuron) | "sparse" (predictor-gated)
    # Speculative decoding (lossless): "off", "self", "lookup" or "model" (with draft_model);
    # tree: expansion per depth such as "1,1,3,1" (None: the drafter's default).
    speculate: str = "off"
    tree: str | None = None
    draft_model: str | None = None
    # How `encode_chat` writes a conversation: "auto" (the file's template, else a transcript
    # a base model continues), "template", "transcript" or a family format ("gemma", ...).
    chat_format: str = "auto"
    # Where the file's bytes live: "on" the memory map, "off" a copy in RAM on huge pages
    # (faster decode), "auto" the copy when the file fits easily in free RAM and the FFNs
    # are not split (resources.reads_weights_into_ram).
    mmap: str = "auto"
    kv_type: str = "f16"  # KV_TYPES

    def __post_init__(self):
        _check_choice("--mmap", self.mmap, MMAP_CHOICES)
        _check_choice("--chat-format", self.chat_format, CHAT_FORMATS)
        _check_choice("--speculate", self.speculate, SPECULATE_CHOICES)
        if (self.speculate == "model") != (self.draft_model is not None):
            raise ConfigError("--speculate model needs --draft-model PATH, and --draft-model "
                              "needs --speculate model")
        if self.tree is not None:
            parse_tree(self.tree)
        if self.n_ctx < 1:
            raise ConfigError(f"--ctx-size must be at least 1, got {self.n_ctx}")
        if self.weights in REMOVED_WEIGHTS:
            raise ConfigError(f"--weights {self.weights}: {REMOVED_WEIGHTS[self.weights]}")
        _check_choice("--weights", self.weights, WEIGHT_CHOICES)
        _check_choice("--ffn-mode", self.ffn_mode, FFN_MODES)
        if self.ffn_mode == "sparse" and self.profile is None:
            raise ConfigError("--ffn-mode sparse needs --profile (the predictors come from "
                              "`ember profile`)")
        _check_choice("--tier-dtype", self.tier_dtype, TIER_CHOICES)
        _check_choice("--tier-attention", self.tier_attention, ATTENTION_CHOICES)
        if self.tier_attention not in ("auto", "host"):
            # a named type moves the file-block runtime's attention onto the tier a budget
            # makes; without either, the flag would be silently ignored
            if self.gpu_budget is None:
                raise ConfigError(f"--tier-attention {self.tier_attention} moves attention onto "
                                  "the GPU tier: give it --gpu-budget BYTES, or drop the flag")
            if self.weights == "fp32":
                raise ConfigError(f"--tier-attention {self.tier_attention} moves the attention "
                                  "of the file's blocks; --weights fp32 runs the float32 "
                                  "reference instead: drop one of the two")
        _check_choice("--split", self.split, SPLITS)
        _check_choice("--kv-type", self.kv_type, KV_TYPES)
        if self.kv_type != "f16" and (self.weights == "fp32" or self.tier_attention not in
                                      ("auto", "host")):
            raise ConfigError(f"--kv-type {self.kv_type} is the host attention's cache on the "
                              "file's blocks; --weights fp32 and --tier-attention TYPE keep "
                              "their own K/V types: drop one of them")
        if self.gpu_budget is not None and self.gpu_budget < 0:
            raise ConfigError("--gpu-budget must not be negative")


def _check_choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {flag} {value!r}; choose one of {', '.join(choices)}")
