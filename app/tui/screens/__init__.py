"""Modal screens: help, per-conversation settings, small dialogs (rename, confirm)."""
