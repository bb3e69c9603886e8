"""The runtime: what turns a loaded model file into generated tokens, in eight rooms.

Each room is a sub-package whose docstring says what it owns. Imports point down this list
only (`tests/test_layering.py` checks it):

- `runtime/`: the `Engine` (options, the model it runs, prompts, a reply's events), the
  device, the memory check before loading, the profile file a run loads.
- `speculative/`: drafters, token trees, the draft-verify-accept step.
- `decode/`: the `Runner` (prefill and decode over a KV cache), the one decode loop plain
  and speculative steps share, sampling, stop strings, the events a stream yields.
- `hybrid/`: FFN layers split by a placement into hot rows on the GPU tier and cold rows on
  CPU threads, the memory plan and the placement solve behind them.
- `body/`: the model body an engine runs, built once: the file's own blocks (`file_blocks_model`),
  the rows a split takes from them, input thresholds.
- `kv/`: the paged KV cache, its blocks and how many each tier gets.
- `options/`: what an engine is built with, as plain values (no torch): each flag's choices
  and default, `EngineOptions`, the sampling settings. Every room may import it.

`profile/` (the `ember profile` pipeline) sits above them all: it runs an `Engine`.
May import `kernels`, `predictors`, `placement` and `models`; never `app`.
"""
