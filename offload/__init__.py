"""The runtime: device placement, runner, sampler, engine stream (and later the hybrid FFN,
paged KV cache and speculative decoding)."""
