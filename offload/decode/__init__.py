"""Batch-1 decoding: the `Runner` (chunked prefill, decode steps and tree verification
over the paged KV cache, and the checks a prompt must pass), the decode loop plain and
speculative steps share (`loop`: prefill timing and every stop condition), the sampler (with
a grammar's token mask from llguidance: `grammar`), stop strings and the events a stream
yields.

May import `body`, `kv` and `options`."""
