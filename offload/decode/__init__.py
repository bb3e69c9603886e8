"""Batch-1 decoding: the `Runner` (chunked prefill, decode steps and tree verification
over the paged KV cache), the sampler, stop strings and the events a stream yields.

May import `body` and `kv`."""
