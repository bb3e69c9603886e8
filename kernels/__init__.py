"""Compute kernels: a plain PyTorch reference for each, then fast versions tested against it.

- `sparse_ffn`: CPU sparse FFN over neuron-major rows (fp32 / int8), C++ with a reference
  fallback (`sparse_ffn_reference`, `cpu_extension`).
"""
