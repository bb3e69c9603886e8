"""Build the file-blocks model a memory plan describes: per layer "gpu", "split" or "cpu".

    "gpu"    attention (and its K/V) and the whole FFN on the tier
    "split"  attention (and its K/V) on the tier; the FFN's hot neurons on the tier, the cold
             ones on the host (offload/hybrid/ffn.py:HybridFFN, file_cold.py)
    "cpu"    the whole layer and its K/V on the host's file blocks

plus the LM head on the tier or the host. `read_layer_modes` is the one place that reads
those decisions from a `MemoryPlan`; `build_placed_model` turns them, the split's FFN layers
and the file's layers into a `FileBlocksModel` whose runs are fixed from then on.

On a CPU tier (the tests' stand-in) whatever the tier holds in the file's blocks is
multiplied by the C++ block kernels (kernels/tier_blocks.py:block_kernels_on): a "gpu" or
"cpu" layer is then one more layer of the one-call C++ pass, a "split" layer's attention runs
in C++ too, one KV pool (in --kv-type) serves every layer, and only the accounting says
which bytes the tier holds. Elsewhere (CUDA) the tier's layers run in torch on the device
(`TierRun`), attention from its tier copies and K/V from a pool on the device in the tier's
K/V type; with some layers left on the host, those run in C++ on K/V kept in host RAM in
--kv-type (the model's `kv_host_layers`: the engine's PagedKVCache splits its pool so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels import tier_blocks

from ..body.file_blocks_model import KV_DTYPE, FileBlocksModel
from ..body.file_layers import FileLayers
from ..body.layer_runs import LayerRun
from ..body.tier_layers import tier_attention_weights, tier_head
from .tier_dtypes import FILE, tier_kv_dtype

MODES = ("gpu", "split", "cpu")


@dataclass(frozen=True)
class LayerModes:
    """What a plan places where: per layer a mode (MODES), whether its attention (and K/V)
    is on the tier, and whether the LM head is."""

    modes: tuple[str, ...]
    attention_on_tier: tuple[bool, ...]
    lm_head_on_tier: bool


def read_layer_modes(plan) -> LayerModes:
    """The plan's per-layer modes and LM head place (its layer_modes and lm_head_on_gpu,
    where the planner fills them; derived from its hot counts and attention_on_gpu until
    then). A layer whose attention the plan keeps on the host
    (`--tier-attention host`) keeps it there whatever its FFN's mode."""
    p = plan.placement
    modes = getattr(plan, "layer_modes", None)
    if not modes:
        full = [p.hot_count(i) == p.ffn_sizes[i] for i in range(p.n_layers)]
        if plan.attention_on_gpu:
            modes = tuple("gpu" if f else "split" for f in full)
        else:
            modes = tuple("cpu" if p.hot_count(i) == 0 else "split" for i in range(p.n_layers))
    if any(m not in MODES for m in modes) or len(modes) != p.n_layers:
        raise ValueError(f"a plan's layer modes must be {p.n_layers} of {MODES}, got {modes}")
    on_tier = tuple(plan.attention_on_gpu and m != "cpu" for m in modes)
    return LayerModes(tuple(modes), on_tier, bool(plan.lm_head_on_gpu))


def build_placed_model(file: FileLayers, hybrid, fmt: str | None, half: torch.dtype,
                       host_kv_dtype: torch.dtype = KV_DTYPE) -> FileBlocksModel:
    """The model over `file`'s layers as the split's plan places them: the split's layers
    are the FFNs (their hot rows on the tier already), `fmt` the tier format of attention
    and the LM head (None: they stay on the host). Records the layers' attention copies on
    the tier and the modes in the split (for its report)."""
    placed = read_layer_modes(hybrid.plan)
    device = hybrid.gpu
    native = tier_blocks.block_kernels_on(device) and fmt == FILE  # the tier's bytes run in C++ here
    on_tier = placed.attention_on_tier if fmt is not None else (False,) * len(file.layers)
    runs, held = [], []
    for i, (mode, ffn) in enumerate(zip(placed.modes, hybrid.layers)):
        # Whole in C++: a host layer whose FFN computes what the file's blocks do (nothing
        # hot, no predictor: its dense twin), or a tier layer whose bytes run here anyway.
        whole = (mode == "cpu" and ffn.dense_fallback() is not None) or (mode == "gpu" and native)
        w = tier_attention_weights(file, i, device, fmt, half) if on_tier[i] else None
        if w is not None:
            held.append(w)  # on a CPU tier in the file's blocks: views of the same bytes
        if w is None or native:  # attention on the file's blocks in C++
            runs.append(LayerRun(None, None if whole else ffn))
        else:
            runs.append(LayerRun(w, ffn))
    hybrid.attention = held or None
    hybrid.layer_modes = placed.modes
    hybrid.whole_layers = tuple(run.ffn is None for run in runs)
    head = None
    if placed.lm_head_on_tier and fmt is not None and not native:
        head = tier_head(file, device, fmt, half)
    # K/V where each layer's attention reads them: tier layers' on the tier in its type,
    # the others' in host RAM in the host's (--kv-type); with no tier runs, one host pool
    host_layers = tuple(i for i, r in enumerate(runs) if r.attention is None)
    if len(host_layers) == len(runs):
        return FileBlocksModel(file, runs, head, (torch.device("cpu"), host_kv_dtype))
    kv = (device, tier_kv_dtype(fmt, device, host_kv_dtype))
    return FileBlocksModel(file, runs, head, kv, (host_layers, host_kv_dtype))
