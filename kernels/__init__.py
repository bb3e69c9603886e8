"""Compute kernels: a plain PyTorch reference for each, and C++ versions tested against it
(`cpu_extension` builds them on first use; without a compiler the references run).

- `block_matmul`: x @ W^T on GGML blocks as the file stores them (Q4_0..Q8_0, K-quants,
  F16/BF16/F32), AVX-512 VNNI / AVX2 / portable paths chosen at run time.
- `decoder_step`: every decoder layer for T rows in one call, on those blocks.
- `fused_ops`: norms, rotary, attention over the paged KV pool, activations; per-row ops that
  replace chains of small PyTorch calls at batch 1.
- `sparse_ffn` (reference: `sparse_ffn_reference`), `ffn_bundles`, `hot_ffn`: the hybrid
  split's cold (CPU, active neurons only) and hot sides.
- `q8_matmul`: the Q8_0 body of the `--weights q8` path.
"""
