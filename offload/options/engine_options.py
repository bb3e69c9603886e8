"""`EngineOptions`: every choice an engine is built with, checked when it is made (a
`ConfigError` naming the flag, never an assert).

Everything the options alone can tell is checked here, before torch is imported or a model
opened: unknown choices, flags that need another flag, files that do not exist. What needs
the model (a budget below its minimum, a profile made for another model) is the engine's to
report as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember.models.chat_format import CHAT_FORMATS
from ember.models.support.errors import ConfigError

from .choices import (ATTENTION_CHOICES, COLD_CHOICES, DEFAULT_BLOCK_SIZE,
                      DEVICE_CHOICES, FFN_MODES, KV_TYPES, MMAP_CHOICES, REMOVED_WEIGHTS,
                      SPECULATE_CHOICES, SPLITS, TIER_CHOICES, WEIGHT_CHOICES)
from .tree_spec import parse_tree


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    # Context in tokens, capped at the model's own length; None: the model's trained length,
    # capped by what RAM holds (resources.context_size).
    n_ctx: int | None = None
    threads: int | None = None
    kv_budget: int | None = None  # device KV pool in bytes; None: one full-length context
    kv_host_budget: int | None = None  # host-RAM pool for swapped-out conversations
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    weights: str = "auto"  # WEIGHT_CHOICES: the file's own blocks, or the float32 reference
    # Hybrid FFN: a GPU-tier byte budget splits FFN layers into hot (GPU tier) and cold
    # (host) neurons; None with split "auto" runs the dense model on one device.
    gpu_budget: int | None = None
    split: str = "auto"  # "auto" | "cpu-only" | "gpu-only" (see memory_plan)
    cold_dtype: str = "auto"  # host-side FFN rows: COLD_CHOICES ("auto": file unless fp32)
    # GPU-tier hot rows: "auto" (by file type and device: int4/int8/fp16, tier_dtypes.py) or
    # one format for every matrix ("int4", "int8", "fp16", "bf16", "fp32").
    tier_dtype: str = "auto"
    # Attention and its KV pool under --gpu-budget: "auto" (on a GPU tier in its 16-bit type
    # when the budget holds them, else on the host's file blocks), "host", or a type that
    # moves them on any device ("bf16", "fp16", "fp32"): tier_dtypes.attention_dtype.
    tier_attention: str = "auto"
    # The card a whole-model plan is priced for (`--gpu NAME`, offload/hybrid/gpu_cards.py);
    # None: a CUDA device's own properties, else the table's first card with the budget.
    gpu: str | None = None
    # A profile artifact (`ember profile`): its placement guides the split and its
    # predictors gate the cold side. ffn_mode "auto" runs sparse when a profile is given.
    profile: str | None = None  # a path, "auto" (this model's default profile if any) or None
    ffn_mode: str = "auto"  # "auto" | "dense" (every neuron) | "sparse" (predictor-gated)
    # Speculative decoding (lossless): "off", "auto" (a draft model found on this machine,
    # else lookup), "self", "lookup" or "model" (with draft_model, and lookup in one tree);
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
        _check_choice("--device", self.device, DEVICE_CHOICES)
        _check_choice("--mmap", self.mmap, MMAP_CHOICES)
        _check_choice("--chat-format", self.chat_format, CHAT_FORMATS)
        if self.n_ctx is not None and self.n_ctx < 1:
            raise ConfigError(f"--ctx-size must be at least 1, got {self.n_ctx}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        if self.weights in REMOVED_WEIGHTS:
            raise ConfigError(f"--weights {self.weights}: {REMOVED_WEIGHTS[self.weights]}")
        _check_choice("--weights", self.weights, WEIGHT_CHOICES)
        self._check_speculation()
        self._check_split()
        self._check_profile()
        self._check_kv_type()

    def _check_speculation(self) -> None:
        _check_choice("--speculate", self.speculate, SPECULATE_CHOICES)
        if (self.speculate == "model") != (self.draft_model is not None):
            raise ConfigError("--speculate model needs --draft-model PATH, and --draft-model "
                              "needs --speculate model")
        if self.draft_model is not None and not Path(self.draft_model).exists():
            raise ConfigError(f"--draft-model {self.draft_model}: no such file or folder")
        if self.tree is not None:
            parse_tree(self.tree)

    def _check_split(self) -> None:
        _check_choice("--split", self.split, SPLITS)
        _check_choice("--cold-dtype", self.cold_dtype, COLD_CHOICES)
        _check_choice("--tier-dtype", self.tier_dtype, TIER_CHOICES)
        _check_choice("--tier-attention", self.tier_attention, ATTENTION_CHOICES)
        for flag, size in (("--gpu-budget", self.gpu_budget), ("--kv-budget", self.kv_budget),
                           ("--kv-host-budget", self.kv_host_budget)):
            if size is not None and size < 0:
                raise ConfigError(f"{flag} must not be negative")
        if self.gpu is not None and self.gpu_budget is None:
            raise ConfigError(f"--gpu {self.gpu} prices a --gpu-budget plan: give it "
                              "--gpu-budget BYTES, or drop the flag")
        if self.split != "auto" and self.gpu_budget is None:
            raise ConfigError(f"--split {self.split} needs --gpu-budget (the GPU tier's size)")
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

    def _check_profile(self) -> None:
        _check_choice("--ffn-mode", self.ffn_mode, FFN_MODES)
        if self.ffn_mode == "sparse" and self.profile is None:
            raise ConfigError("--ffn-mode sparse needs --profile (the predictors come from "
                              "`ember profile`)")
        if self.profile not in (None, "auto") and not Path(self.profile).is_file():
            raise ConfigError(f"--profile {self.profile}: no such file")

    def _check_kv_type(self) -> None:
        _check_choice("--kv-type", self.kv_type, KV_TYPES)
        if self.kv_type != "f16" and (self.weights == "fp32" or self.tier_attention not in
                                      ("auto", "host")):
            raise ConfigError(f"--kv-type {self.kv_type} is the host attention's cache on the "
                              "file's blocks; --weights fp32 and --tier-attention TYPE keep "
                              "their own K/V types: drop one of them")


def _check_choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {flag} {value!r}; choose one of {', '.join(choices)}")
