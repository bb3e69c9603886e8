"""Input thresholds at run time: each thresholded matmul of a `QuantModel` reads only the
weight columns of inputs with |x| > its threshold (kernels/input_sparse.py).

A layer has four matmul slots, each with one input: "qkv" (the attention-normed hidden state,
shared by q, k and v), "o" (the attention output), "gate_up" (the FFN-normed hidden state) and
"down" (act(gate) * up). A slot with a threshold runs over its weights' input-major layout,
derived once here from the file's blocks; the others stay on the file's blocks. Counters in
the C++ step record, per slot, the inputs kept and seen, so the sparsity reported is the one
realized while decoding (not an offline estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.kernels import input_sparse as isp
from ember.kernels.decoder_step import DecoderLayer
from ember.models.errors import ConfigError
from ember.models.weights import QTensor

SLOTS = ("qkv", "o", "gate_up", "down")
# Matmuls fed by each slot's input (q/k/v and gate/up share one input each): a mean "over the
# body's matmuls" counts each of q, k, v, o, gate, up and down once.
MATMULS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}

Thresholds = list[dict[str, float]]  # per layer: slot -> threshold (slots absent: dense)
# Input-major block types: "q8_0" re-rounds the file's values finely (0.5% RMS on random rows;
# the default model's held-out perplexity barely moves), "bits" keeps about the file's bits
# (Q4_K -> Q4_0, Q5_0 -> Q5_0: as many bytes, but a second rounding that cost the default
# model x1.057 held-out perplexity with almost no inputs dropped).
LAYOUTS = ("q8_0", "bits")


def slot_weights(layer: DecoderLayer, slot: str) -> list[QTensor]:
    """The file's weights of one matmul slot, side by side in the order the step reads."""
    return {"qkv": layer.qkv, "o": [layer.wo], "gate_up": layer.gate_up,
            "down": [layer.down]}[slot]


def check_thresholds(thresholds, n_layers: int) -> Thresholds:
    """ValueError-free validation for thresholds from a file: a ConfigError naming the fault."""
    if not isinstance(thresholds, list) or len(thresholds) != n_layers:
        raise ConfigError(f"input thresholds must be a list of {n_layers} layers")
    out = []
    for i, layer in enumerate(thresholds):
        if not isinstance(layer, dict) or not set(layer) <= set(SLOTS):
            raise ConfigError(f"input thresholds of layer {i} must map slots {SLOTS} to numbers")
        for slot, value in layer.items():
            if not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise ConfigError(f"input threshold {slot} of layer {i} must be a finite "
                                  f"number >= 0, got {value!r}")
        out.append({s: float(v) for s, v in layer.items()})
    return out


@dataclass
class InputSparsity:
    """Thresholds applied to one QuantModel, with the layouts they read and their counters."""

    model: object  # QuantModel
    thresholds: Thresholds
    layout: str = "q8_0"  # one of LAYOUTS
    layouts: dict[tuple[int, str], list[isp.InputMajor]] = field(default_factory=dict)
    stats: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def set_thresholds(self, thresholds: Thresholds) -> None:
        """Apply new thresholds (a calibration search tries several): layouts are derived once
        per slot, the first time it is thresholded; a slot left out goes back to the file."""
        step = self.model.native_step()
        for i, layer in enumerate(self.model.layers):
            for s, slot in enumerate(SLOTS):
                key = (i, slot)
                value = thresholds[i].get(slot) if i < len(thresholds) else None
                if value is None:
                    if key in self.stats:
                        step.set_input_sparse(i, s, [], [], [], -1.0, self.stats[key])
                    continue
                if key not in self.layouts:
                    im_type = isp.IM_TYPES[-1] if self.layout == "q8_0" else None
                    self.layouts[key] = [isp.relayout(w, im_type)
                                         for w in slot_weights(layer, slot)]
                    self.stats[key] = torch.zeros(2, dtype=torch.int64)
                ims = self.layouts[key]
                step.set_input_sparse(i, s, [w.packed for w in ims], [w.qtype for w in ims],
                                      [w.shape[0] for w in ims], float(value), self.stats[key])
        self.thresholds = [dict(t) for t in thresholds]

    def reset_counters(self) -> None:
        for s in self.stats.values():
            s.zero_()

    def realized(self) -> dict:
        """Sparsity realized since the last reset: per layer and slot; the mean over every
        matmul of the body (q, k, v, o, gate, up, down each once; a slot without a threshold
        counts as 0) and over the thresholded slots."""
        per_layer, all_slots, thresholded = [], [], []
        for i in range(len(self.model.layers)):
            row = {}
            for slot in SLOTS:
                st = self.stats.get((i, slot))
                value = 0.0 if st is None or int(st[1]) == 0 else 1 - int(st[0]) / int(st[1])
                row[slot] = round(value, 4)
                all_slots += [value] * MATMULS[slot]
                if st is not None:
                    thresholded.append(value)
            per_layer.append(row)
        return {"per_layer": per_layer,
                "mean_thresholded": round(sum(thresholded) / max(1, len(thresholded)), 4),
                "mean_body": round(sum(all_slots) / max(1, len(all_slots)), 4)}

    def relayout_errors(self) -> dict:
        """How far the derived layouts' values are from the file's (RMS of the difference over
        RMS of the values, per matmul): the worst and the mean over every thresholded one."""
        errors = [isp.relayout_error(w, im) for (i, slot), ims in self.layouts.items()
                  for w, im in zip(slot_weights(self.model.layers[i], slot), ims)]
        return {"max": max(errors, default=0.0),
                "mean": sum(errors) / len(errors) if errors else 0.0, "matmuls": len(errors)}

    def layout_bytes(self) -> int:
        """Bytes of the derived input-major weights (the file's copies of those matmuls are
        no longer read)."""
        return sum(w.nbytes for ims in self.layouts.values() for w in ims)

    def bytes_per_token(self) -> tuple[int, int]:
        """(bytes a dense token reads of the body's matmuls on the file, bytes the last
        counted tokens read on average): the ideal speedup of the body is their ratio."""
        dense = sparse = 0.0
        for i, layer in enumerate(self.model.layers):
            for slot in SLOTS:
                file_bytes = sum(w.nbytes for w in slot_weights(layer, slot))
                dense += file_bytes
                st = self.stats.get((i, slot))
                if st is None or int(st[1]) == 0:
                    sparse += file_bytes
                else:
                    im = sum(w.nbytes for w in self.layouts[(i, slot)])
                    sparse += im * int(st[0]) / int(st[1])
        return int(dense), int(sparse)


def apply_input_sparsity(model, thresholds: Thresholds, layout: str = "q8_0") -> InputSparsity:
    """Threshold `model`'s (a QuantModel's) matmul inputs as `thresholds` says, over
    input-major weights of `layout` (LAYOUTS)."""
    thresholds = check_thresholds(thresholds, len(model.layers))
    if layout not in LAYOUTS:
        raise ConfigError(f"input-major layout must be one of {', '.join(LAYOUTS)}, got "
                          f"{layout!r}")
    if not isp.available():
        raise ConfigError("input thresholds need Ember's C++ CPU kernels, which are not built "
                          "here (a C++ compiler is needed at first use)")
    runtime = InputSparsity(model, thresholds, layout)
    runtime.set_thresholds(thresholds)
    return runtime
