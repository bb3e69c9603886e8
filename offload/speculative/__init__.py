"""Lossless speculative decoding: drafters propose a token tree (`token_tree`), the target
verifies it in one pass and the acceptance rule keeps the target's own distribution
(`verify`: the step the shared decode loop of `decode` runs, and the tree sizer).

May import `decode`, `body`, `kv` and `options`."""
