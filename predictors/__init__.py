"""Activation statistics and per-layer MLP activation predictors (filled by `ember profile`)."""
