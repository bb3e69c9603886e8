"""Synthetic models for tests and benchmarks (`synthetic.py`): tiny configs and random or
confident weights in every family's shapes, written as GGUF files or Hugging Face folders.
Never used by the app at run time (tests/test_layering.py checks who imports it)."""
