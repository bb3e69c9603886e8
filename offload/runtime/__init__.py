"""The Engine and what it needs before loading: options, device and thread choice, the
memory check, the profile file a run loads.

May import every room but `profile`."""
