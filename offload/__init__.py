"""The runtime: what turns a loaded model file into generated tokens.

- Engine and loop: `engine` (options, the per-reply stream), `runner` (prefill/decode over a
  KV cache), `sampler`, `stopping`, `events`, `device`, `resources` (the memory check before
  loading), `sizes` (byte sizes as flags take and print them).
- The model an engine runs: `quant_model` (the file's own GGML blocks on the CPU, one C++
  call per pass), or the float32 reference with `quant_body` / `fused_*` / `lm_head` for
  `--weights fp32/q8` and GPU devices.
- KV cache: `paged_kv`, `kv_blocks`, `kv_plan`, `sequence_kv`.
- Hybrid split: `hybrid_setup`, `hybrid_ffn`, `ffn_rows`, `memory_plan`, `placement_solver`,
  `cpu_worker`, `neuron_selectors`.
- Speculation: `speculative`, `speculative_setup`, `drafters`, `token_tree`.
- Profiling: `profiler`, `profile_artifact`, `cost_probe`; `perplexity`.

May import `kernels`, `predictors`, `placement` and `models`; never `app`.
"""
