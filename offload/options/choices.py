"""Each engine flag's choices and defaults, defined once.

The CLI's flags, `EngineOptions`, the chat app's settings and the server read them from here;
the rooms that act on a choice (hybrid, speculative, kv) import the same tuples.
"""

from __future__ import annotations

# The context a benchmark gives both engines it compares, unless told otherwise (an engine's
# own default is the model's trained length, capped by RAM: EngineOptions.n_ctx).
BENCH_CTX = 4096
# Tokens `ember generate` writes unless --max-tokens says otherwise; a chat reply's default is
# longer (a conversation's answers run longer than a continuation).
DEFAULT_MAX_TOKENS = 256
DEFAULT_CHAT_MAX_TOKENS = 512
# Tokens per block of the paged KV cache.
DEFAULT_BLOCK_SIZE = 16

DEVICE_CHOICES = ("auto", "cpu", "cuda")
# --weights: "auto" the file's own blocks, "fp32" the float32 reference (what perplexity
# comparisons are made against).
WEIGHT_CHOICES = ("auto", "fp32")
# Choices that once selected the requantized Q8_0 copies of the float32 model (issue 21).
REMOVED_WEIGHTS = {"q8": "removed: the default runtime (--weights auto) reads the file's own "
                         "blocks; --weights fp32 runs the float32 reference"}
MMAP_CHOICES = ("auto", "on", "off")
# --kv-type: the file-blocks runtime's KV cache, float16, Q8_0 blocks (34 bytes per 32
# values: 0.53x the bytes, as llama.cpp's -ctk/-ctv q8_0) or bfloat16 (the bytes of float16;
# AVX512_BF16's dot products where the CPU has them: docs/long-context.md).
KV_TYPES = ("f16", "q8_0", "bf16")
# --split under --gpu-budget: hot neurons fill the budget, none hot, or every one hot.
SPLITS = ("auto", "cpu-only", "gpu-only")
# FFN rows on the GPU tier: "auto" = "file", the file's own blocks (kernels/tier_blocks.py);
# or one re-quantized format for all (offload/hybrid/tier_dtypes.py).
FILE = "file"
TIER_FORMATS = ("int4", "int8", "fp16", "bf16", "fp32")
TIER_CHOICES = ("auto", FILE) + TIER_FORMATS
# Attention, its KV pool and the LM head under --gpu-budget: "auto" on the tier in the file's
# blocks where the plan puts them, "host", or that format on the tier.
ATTENTION_FORMATS = (FILE, "int8", "int4", "bf16", "fp16", "fp32")
ATTENTION_CHOICES = ("auto", "host") + ATTENTION_FORMATS
# Host-side FFN rows of a split: "file" keeps GLU layers on the file's blocks.
COLD_DTYPES = ("fp32", "int8", "file")
COLD_CHOICES = ("auto",) + COLD_DTYPES
FFN_MODES = ("auto", "dense", "sparse")
# --speculate: "auto" drafts with a much smaller model of the same tokenizer when one is on
# this machine, else with prompt lookup (offload/speculative/draft_choice.py).
SPECULATE_CHOICES = ("off", "auto", "self", "lookup", "model")
