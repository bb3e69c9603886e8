"""The user-facing layer: the `ember` CLI (and later the Textual chat app). Nothing imports it."""
