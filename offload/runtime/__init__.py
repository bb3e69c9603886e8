"""The Engine and what it needs: its options (`engine_options`), the model it runs, split or not
(`engine_model`), prompts and chat formats (`prompts`), a reply's events (`replies`), device
and thread choice, the memory check before loading, the profile file a run loads.

May import every room but `profile`."""
