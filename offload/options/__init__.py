"""What an engine is built with, as plain values: every flag's choices and default
(`choices`), `EngineOptions` and its checks (`engine_options`), the sampling settings
(`sampling`) and the draft-tree spec (`tree_spec`). No torch behind any of it, so the CLI,
`ember chat` and `--help` read the same defaults and checks without waiting for torch.

Imports no other room; every room may import it."""
