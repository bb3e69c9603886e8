"""The ground floor every room shares, with no model code: Ember's errors (`errors.py`), byte
sizes as people write them (`sizes.py`), the user's cache and config folders (`user_dirs.py`),
files written whole or not at all (`atomic.py`) and giving freed heap back to the OS
(`heap.py`). Imports nothing else from Ember."""
