"""`ember profile`: calibration text through an `Engine`, activation statistics, predictors or
input thresholds, measured costs, a placement, one profile file; and perplexity.

May import every other room."""
