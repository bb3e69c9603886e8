"""Activation statistics and per-layer MLP activation predictors (filled by `ember profile`).

The profiling flow, one module per step:

1. `calibration_text`: calibration and held-out token ids (a corpus split, or the model
   continuing varied seed prompts through any `generate(ids, n)` callable).
2. `collect`: run the model over the calibration ids with its FFNs temporarily swapped for
   recording wrappers (`ffn_swap`): per-neuron activity frequency and mean |h| per layer, and a
   bounded sample of FFN inputs with their |h| (`stats`).
3. `glu_calibration` (GLU models only): per-layer |h| thresholds defining "inactive", chosen to
   keep held-out perplexity within a budget. ReLU-family models use threshold 0.
4. `train`: one `mlp.Predictor` per layer from the sample; layers where a predictor does not
   pay for itself stay dense. `mlp.PredictorSet.to_tensors()` is what the artifact stores.

Modules import torch; import them where used so the CLI starts without it.
"""
