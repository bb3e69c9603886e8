"""Compute kernels: a plain PyTorch reference for each, then fast versions tested against it.

Filled by the hybrid-FFN and decode-speed issues (sparse FFN, quantized matvec).
"""
