"""Compute kernels: model-agnostic (tensors and switches in, tensors out; what a model means by
them is decided in offload/body/ and models/). `cpu_extension` builds the C++ versions on first
use; without a compiler, or with EMBER_KERNELS=reference, the references run.

One convention for every op module: `op(...)` (the fast version where there is one),
`op_reference(...)` beside it in the same module (the plain PyTorch it is tested against, same
arguments) and `available()` (whether `op` runs the fast version here). Unqualified, "block"
here means a GGML quant block (32 or 256 values with their scales); a transformer block or a
KV block is named as such. The FFN activations come from one table, models/activations.py,
whose codes the C++ kernels receive (csrc/activation.h).

- `block_matmul`: x @ W^T on GGML quant blocks as the file stores them (Q4_0..Q8_0, K-quants,
  F16/BF16/F32), AVX-512 VNNI / AVX2 / portable paths chosen at run time (EMBER_CPU_PATH).
- `decoder_step`: every decoder layer for T rows in one call, on those blocks.
- `input_sparse`: x @ W^T reading only the weight columns of inputs above a threshold, on
  input-major tiles of the file's blocks (`tile_layout`: the same bytes, re-ordered).
- `fused_ops`: norms, rotary, attention over the paged KV pool, activations, argmax/top-k;
  per-row ops that replace chains of small PyTorch calls at batch 1.
- `sparse_ffn` (over `ffn_bundles`, one contiguous bundle per neuron) and `hot_ffn` (over
  `tier_weights`' formats): the hybrid split's cold (CPU, active neurons only) and hot sides.
- `q8_matmul`: float32 -> Q8_0 rows at load, and the first Q8_0 matmul (benchmarked against
  `block_matmul`).
"""
