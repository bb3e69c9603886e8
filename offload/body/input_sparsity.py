"""Input thresholds at run time: each thresholded matmul of a `FileBlocksModel` reads only the
weight columns of inputs with |x| > its threshold (kernels/input_sparse.py).

A layer has four matmul slots, each with one input: "qkv" (the attention-normed hidden state,
shared by q, k and v), "o" (the attention output), "gate_up" (the FFN-normed hidden state) and
"down" (act(gate) * up). A slot with a threshold runs over its weights' input-major tiles
(kernels/input_sparse.py), derived once here from the file's blocks: the same bytes re-ordered,
so its values are the file's; the others stay on the file's blocks. Counters in the C++ step
record, per slot, the inputs kept and seen, so the sparsity reported is the one realized while
decoding (not an offline estimate), and the bytes a token reads follow from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.kernels import input_sparse as isp
from ember.kernels import tile_layout as tl
from ember.kernels.page_advice import release_pages
from ember.kernels.decoder_step import DecoderLayer
from ember.models import quants
from ember.models.support.errors import ConfigError
from ember.models.weights import QTensor

SLOTS = ("qkv", "o", "gate_up", "down")
# Matmuls fed by each slot's input (q/k/v and gate/up share one input each): a mean "over the
# body's matmuls" counts each of q, k, v, o, gate, up and down once.
MATMULS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}

Thresholds = list[dict[str, float]]  # per layer: slot -> threshold (slots absent: dense)
# The input-major layout: "tiles", the file's blocks re-ordered. Profiles written before the
# tiles name the re-rounded layouts they were calibrated on ("q8_0", "bits"); their thresholds
# apply unchanged (the tiles hold the file's values, which those layouts approximated).
LAYOUTS = ("tiles", "q8_0", "bits")


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
    """Thresholds applied to one FileBlocksModel, with the layouts they read and their counters."""

    model: object  # FileBlocksModel
    thresholds: Thresholds
    layout: str = "tiles"
    layouts: dict[tuple[int, str], list[isp.InputMajor]] = field(default_factory=dict)
    stats: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    released: dict[tuple[int, str], int] = field(default_factory=dict)  # slot -> bytes let go

    def set_thresholds(self, thresholds: Thresholds) -> None:
        """Apply new thresholds (a calibration search tries several): layouts are derived once
        per slot, the first time it is thresholded; a slot left out goes back to the file."""
        _check_types(self.model, thresholds)
        back = [key for key in self.released if thresholds[key[0]].get(key[1]) is None]
        if back:
            raise ConfigError(f"the file's copy of layer {back[0][0]}'s {back[0][1]} weights was "
                              f"released (release_file_copies): that slot cannot run dense again")
        step = self.model.native_step()
        for i in range(len(self.model.layers)):
            for s, slot in enumerate(SLOTS):
                key = (i, slot)
                value = thresholds[i].get(slot) if i < len(thresholds) else None
                if value is None:
                    if key in self.stats:
                        step.set_input_sparse(i, s, [], [], [], -1.0, self.stats[key])
                    continue
                ims = self.tiles(i, slot)
                self.stats.setdefault(key, torch.zeros(2, dtype=torch.int64))
                step.set_input_sparse(i, s, [w.packed for w in ims], [w.qtype for w in ims],
                                      [w.shape[0] for w in ims], float(value), self.stats[key])
        self.thresholds = [dict(t) for t in thresholds]

    def tiles(self, layer: int, slot: str) -> list[isp.InputMajor]:
        """One slot's input-major tiles, derived from the file's blocks the first time asked
        (a profile's probes read them too, through their own one-layer steps)."""
        key = (layer, slot)
        if key not in self.layouts:
            _check_types(self.model, [{slot: 0.0} if i == layer else {}
                                      for i in range(len(self.model.layers))])
            self.layouts[key] = [isp.relayout(w) for w in slot_weights(self.model.layers[layer],
                                                                         slot)]
        return self.layouts[key]

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

    def release_file_copies(self) -> int:
        """Let the OS take back the pages of the file's copies of every thresholded weight (the
        tiles replace them, so the model is not held twice): those matmuls read only their
        tiles from now on, and set_thresholds refuses to put them back on the file. Returns
        the bytes released.

        Only a memory-mapped file's pages are released: whoever else reads them (a second
        engine on the same loaded model, the self-drafter's layers, a float reference built
        later) gets them back from the file. The pages of a copy in RAM (or of tensors a
        library read into memory) would read as zeros to those readers, so that copy is left
        whole (the tiles then cost their bytes again)."""
        if not getattr(self.model.file.weights, "mapped", False):
            return 0
        for key in self.layouts:
            if key not in self.released and self.thresholds[key[0]].get(key[1]) is not None:
                weights = slot_weights(self.model.layers[key[0]], key[1])
                self.released[key] = sum(release_pages(w.raw) for w in weights)
        return sum(self.released.values())

    def layout_bytes(self) -> int:
        """Bytes of the derived input-major tiles (the file's copies of those matmuls are no
        longer read)."""
        return sum(w.nbytes for ims in self.layouts.values() for w in ims)

    def bytes_per_token(self) -> tuple[int, int]:
        """(bytes a dense token reads of the body's matmuls on the file, bytes the last
        counted tokens read on average): the ideal speedup of the body is their ratio. A
        thresholded matmul reads every super-block's header (each row's scales) and the runs
        of the inputs kept; the padding rows of a short last group count too."""
        dense = sparse = 0.0
        for i, layer in enumerate(self.model.layers):
            for slot in SLOTS:
                file_bytes = sum(w.nbytes for w in slot_weights(layer, slot))
                dense += file_bytes
                st = self.stats.get((i, slot))
                if st is None or int(st[1]) == 0 or self.thresholds[i].get(slot) is None:
                    sparse += file_bytes
                    continue
                for w in self.layouts[(i, slot)]:
                    header, run = tl.header_and_run_bytes(w.qtype, *w.shape)
                    sparse += header + run * w.shape[1] * int(st[0]) / int(st[1])
        return int(dense), int(sparse)


def _check_types(model, thresholds: Thresholds) -> None:
    for i, layer in enumerate(model.layers):
        for slot in thresholds[i] if i < len(thresholds) else ():
            for w in slot_weights(layer, slot):
                if not isp.tiled(w.qtype):
                    names = ", ".join(quants.type_name(t) for t in isp.TILED_TYPES)
                    raise ConfigError(
                        f"input thresholds run on quantized weights ({names}); layer {i}'s "
                        f"{slot} matmul is {quants.type_name(w.qtype)}: use a quantized file "
                        f"or leave that slot dense")


def apply_input_sparsity(model, thresholds: Thresholds, layout: str = "tiles") -> InputSparsity:
    """Threshold `model`'s (a FileBlocksModel's) matmul inputs as `thresholds` says, over
    input-major tiles of the file's blocks (`layout`: one of LAYOUTS, all meaning the tiles)."""
    thresholds = check_thresholds(thresholds, len(model.layers))
    if layout not in LAYOUTS:
        raise ConfigError(f"input-major layout must be one of {', '.join(LAYOUTS)}, got "
                          f"{layout!r}")
    if not isp.available():
        raise ConfigError("input thresholds need Ember's C++ CPU kernels, which are not built "
                          "here (a C++ compiler is needed at first use)")
    runtime = InputSparsity(model, thresholds)
    runtime.set_thresholds(thresholds)
    return runtime
