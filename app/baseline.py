"""llama.cpp (through llama-cpp-python, the optional `[baseline]` extra) as a side-by-side
reference: same model file, same token ids, same windows, measured in the same process."""

from __future__ import annotations

import time

import numpy as np
from gguf import GGMLQuantizationType

from ember.models.support.errors import EmberError
from ember.offload.profile.perplexity import PerplexityResult, windows


def layers_in_budget(source, budget: int, n_ctx: int) -> int:
    """llama.cpp's layer offload (`-ngl`) for a GPU budget: as many whole layers as fit, each
    with its float16 K/V at `n_ctx` tokens, then the output layer as one more (-ngl beyond
    the layer count) when it fits too: what the same budget buys the plain tool."""
    cfg, w = source.config, source.weights
    kv = 2 * n_ctx * cfg.n_kv_heads * cfg.head_dim * 2
    left, n = budget, 0
    for i in range(cfg.n_layers):
        layer = sum(w.get(name).nbytes for name in w.names() if name.startswith(f"blk.{i}."))
        if layer + kv > left:
            return n
        left, n = left - layer - kv, n + 1
    head = w.get("token_embd.weight" if cfg.tied_embeddings else "output.weight").nbytes
    return n + (head <= left)


# Ember's --kv-type as llama.cpp's cache type (its -ctk/-ctv): GGML's type numbers (llama_cpp
# names no constant for bfloat16).
LLAMA_KV_TYPES = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0,
                  "bf16": GGMLQuantizationType.BF16}
QUANTIZED_KV = ("q8_0",)  # llama.cpp keeps these only with flash attention (its V needs it)


def flash_variants(kv_type: str) -> dict[str, bool]:
    """llama.cpp's runs to compare a cache type against (name -> flash_attn): flash attention
    off and on, whichever is faster counts; on alone for a quantized cache."""
    if kv_type in QUANTIZED_KV:
        return {"llama.cpp_flash": True}
    return {"llama.cpp": False, "llama.cpp_flash": True}


class LlamaCpp:
    def __init__(self, path, threads: int, n_ctx: int, logits_all: bool = False,
                 n_gpu_layers: int = 0, flash_attn: bool | None = None, kv_type: str = "f16"):
        """flash_attn None: off, unless the cache type needs it (a quantized one does)."""
        try:
            import llama_cpp
        except ImportError:
            raise EmberError("the llama.cpp baseline is not installed: pip install -e '.[baseline]' "
                             "(README: build flags for these CPUs)") from None
        if kv_type not in LLAMA_KV_TYPES:
            raise EmberError(f"no llama.cpp KV cache type for {kv_type!r}; "
                             f"choose from {', '.join(LLAMA_KV_TYPES)}")
        if flash_attn is None:
            flash_attn = kv_type in QUANTIZED_KV
        if kv_type in QUANTIZED_KV and not flash_attn:
            raise EmberError(f"llama.cpp keeps a {kv_type} KV cache only with flash attention")
        cache_type = int(LLAMA_KV_TYPES[kv_type])
        self.kv_type, self.flash_attn = kv_type, flash_attn
        # Whether this build offloads at all (a CPU-only wheel ignores n_gpu_layers)
        self.gpu_offload = bool(getattr(llama_cpp, "llama_supports_gpu_offload", bool)())
        self.n_gpu_layers = n_gpu_layers
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads,
                                   n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                                   logits_all=logits_all, n_gpu_layers=n_gpu_layers,
                                   flash_attn=flash_attn, type_k=cache_type,
                                   type_v=cache_type, verbose=False)

    def decode_speed(self, ids: list[int], gen: int) -> dict:
        """Greedy: prefill `ids`, then `gen` tokens; tokens/s of each phase, and the tokens."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        tokens = [self._next_greedy()]
        t2 = time.perf_counter()
        for _ in range(gen - 1):
            llm.eval([tokens[-1]])
            tokens.append(self._next_greedy())
        t3 = time.perf_counter()
        return {"prefill": len(ids) / (t1 - t0), "decode": (gen - 1) / (t3 - t2),
                "token_ids": tokens}

    def _next_greedy(self) -> int:
        """Argmax of the last evaluated token's logits. Read from the context: without
        logits_all, llama-cpp-python does not copy them into `Llama.scores`."""
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def perplexity(self, text_ids: list[int], bos_id: int, window: int,
                   stride: int | None = None) -> PerplexityResult:
        """Same windows and scoring as `ember.offload.profile.perplexity` (needs logits_all=True)."""
        stride = stride or max(1, (window - 1) // 2)
        total = PerplexityResult(0, 0.0)
        for begin, end, first in windows(len(text_ids), window, stride):
            ids = [bos_id] + text_ids[begin:end]
            self.llm.reset()
            self.llm.eval(ids)
            for row in range(first - begin, len(ids) - 1):
                z = self.llm.scores[row].astype(np.float64)  # one row: long windows x 150k
                m = z.max()                                 # vocabularies are gigabytes
                total.nll -= z[ids[row + 1]] - (m + np.log(np.exp(z - m).sum()))
                total.tokens += 1
        return total
