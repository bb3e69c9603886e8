"""Turn a loaded dense model into a hybrid one: plan the GPU tier, split every FFN layer.

`split_ffns` plans the GPU tier and slices each FFN layer straight into its homes (hot rows
to the GPU tier, cold rows stay in host RAM), one layer at a time, from the file's blocks
(an engine on them, offload/body/file_blocks_model.py) or from the float32 model's FFNs; it changes
nothing it reads, so engines on one file stay independent.

`build_hybrid` is the legacy path on the float32 `Transformer` (`--weights fp32/q8`, a GPU
device): it installs the split layers in the model's blocks before anything moves to a
device, keeping each dense FFN on the host as the layer's `source` so another engine can
split the same loaded model differently (`restore_dense`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels import q8_matmul
from ember.kernels.page_advice import release_pages
from ember.kernels.tier_attention import TRITON_OPS, layer_ops
from ember.models.support.errors import ConfigError
from ember.models.support.heap import release_free_heap
from ember.models.transformer import FeedForward, Transformer

from ..options.choices import COLD_CHOICES
from .cpu_worker import CpuWorker
from ..body.ffn_rows import as_rows
from .ffn import HybridFFN, Selector
from .memory_plan import ComponentBytes, MemoryPlan, neuron_bytes, plan_memory
from .tier_dtypes import TierChoice



def resolve_cold_dtype(choice: str, weights: str = "auto") -> str:
    """"file": GLU layers no predictor gates keep their cold rows in the file's blocks
    (file_cold.py), the others int8 bundles. "auto": "file" when the C++ kernels are built
    and --weights is not fp32 (less RAM and faster: docs/gpu-tier.md, "The split"); fp32
    bundles when the float32 reference is asked for or there are no kernels."""
    if choice == "file" and weights == "fp32":
        raise ConfigError("--cold-dtype file keeps the cold rows in the file's blocks, which "
                          "--weights fp32 does not run on; use --cold-dtype fp32 or int8")
    if choice != "auto":
        return choice
    return "file" if weights != "fp32" and q8_matmul.available() else "fp32"



UNLIMITED = 1 << 62  # "no GPU-tier budget": everything the plan wants fits


@dataclass
class HybridModel:
    plan: MemoryPlan
    layers: list[HybridFFN]
    worker: CpuWorker
    gpu: torch.device  # the GPU tier's device (the CPU when there is no GPU)
    cold_dtype: str = "fp32"  # the cold side's rows: "fp32" or "int8" bundles, or "file"
    # Per layer, attention's weights on the tier (kernels/tier_attention.py), when the
    # file-blocks runtime moved them there (offload/body/tier_layers.py)
    attention: list | None = None
    file_bytes_released: int = 0  # mapped file pages the cold side's copies replaced
    # Per layer "gpu", "split" or "cpu" as the file-blocks model was built (placed_model.py),
    # and whether it runs whole there (every neuron, not through its HybridFFN)
    layer_modes: tuple[str, ...] | None = None
    whole_layers: tuple[bool, ...] | None = None

    @property
    def attention_device(self) -> torch.device:
        return self.gpu if self.plan.attention_on_gpu else torch.device("cpu")

    def reset_counters(self) -> None:
        for layer in self.layers:
            layer.counters.reset()

    def cold_kinds(self) -> str:
        """What the cold sides hold: "file", "int8" or "fp32", or several joined by "+"
        (`--cold-dtype file` keeps bundles where the file's blocks cannot serve: a layer a
        predictor gates, a plain MLP, a type the tiles lack)."""
        kinds = sorted({"file" if layer.cold_file is not None else layer.cold.dtype
                        for layer in self.layers if layer.has_cold_side})
        return "+".join(kinds) if kinds else self.cold_dtype

    def report(self) -> dict:
        """The plan plus what the layers computed since the last reset."""
        whole = self.whole_layers or (False,) * len(self.layers)
        computed = [1.0 if w else layer.computed_fraction()
                    for w, layer in zip(whole, self.layers)]
        known = [c for c in computed if c is not None]
        return {
            **self.plan.to_dict(),
            "gpu_tier_device": str(self.gpu),
            "gpu_ffn_bytes": sum(layer.gpu_bytes() for layer in self.layers),
            "gpu_ffn_bytes_per_layer": [layer.gpu_bytes() for layer in self.layers],
            "host_ffn_bytes": sum(layer.host_bytes() for layer in self.layers),
            "host_ffn_dtype": self.cold_kinds(),
            "gpu_ffn_formats": tier_summary(self.layers),
            # Of both sides' bytes: down made neuron-major (derived from the file, not a view).
            "down_neuron_major_bytes": sum(layer.down_nm_bytes() for layer in self.layers),
            "computed_fraction_per_layer": [None if c is None else round(c, 4) for c in computed],
            # Per layer, mean ms per decode token: hot side, cold side, the caller's wait.
            "layer_timing_ms": [layer.counters.timing_ms() for layer in self.layers],
            "sparsity": None if not known else round(1 - sum(known) / len(known), 4),
            # Per layer, the profile's input threshold on the cold side's down input (None:
            # the cold side computes every neuron it is given).
            "cold_down_thresholds": [layer.down_threshold for layer in self.layers],
            # The mapped file's FFN pages let go where the cold side holds the file's blocks.
            "file_bytes_released": self.file_bytes_released,
            "tier_attention_weights": attention_summary(self.attention),
            "tier_kernels": tier_kernels(self.attention, self.layers),
            "layer_modes": None if self.layer_modes is None else list(self.layer_modes),
        }

    def close(self) -> None:
        self.worker.close()


def tier_summary(layers: list[HybridFFN]) -> dict:
    """Per matrix kind: the tier formats in use (format -> layers) and the conversion error
    from the file's rows, measured at split (relative Frobenius, mean and max over layers)."""
    out = {}
    for kind in ("gate_up", "down"):
        hot = [layer.hot for layer in layers if layer.hot is not None]
        fmts: dict[str, int] = {}
        for w in hot:
            fmt = getattr(w, kind).fmt
            fmts[fmt] = fmts.get(fmt, 0) + 1
        errors = [w.conversion_error()[kind] for w in hot]
        out[kind] = {"formats": fmts,
                     "error_mean": round(sum(errors) / len(errors), 5) if errors else None,
                     "error_max": round(max(errors), 5) if errors else None}
    return out


def tier_kernels(attention: list | None, layers: list[HybridFFN]) -> dict:
    """What runs the tier's work: its matrices by the C++ block kernels (a CPU tier), the
    fused Triton kernel or torch ops (each kind in use), and attention's other steps (norms,
    rotary, K/V store, attention) by C++, Triton or torch ops (None: attention on the host)."""
    matrices = [w.qkv for w in attention or []] + [w.o for w in attention or []]
    for layer in layers:
        if layer.hot is not None:
            matrices += [layer.hot.gate_up, layer.hot.down]

    def kind(m) -> str:
        return "c++" if getattr(m, "native", False) else \
            "triton" if getattr(m, "fused", False) else "torch"

    steps = None
    if attention:  # a CPU tier's layers in the file's blocks run whole in the C++ pass
        steps = "c++" if getattr(attention[0].qkv, "native", False) else \
            "triton" if layer_ops(attention[0].device) is TRITON_OPS else "torch"
    return {"matrices": sorted({kind(m) for m in matrices}), "layer_steps": steps}


def attention_summary(layers: list | None) -> dict | None:
    """What attention holds on the tier (None: nothing, it runs on the host): its format
    ("file": the file's blocks), the bytes of its tensors, and per matrix (qkv, o) the
    conversion error from the file's values (relative Frobenius, mean and max over layers)."""
    if not layers:
        return None
    out = {"format": layers[0].fmt, "layers": len(layers), "device": str(layers[0].device),
           "bytes": sum(w.nbytes() for w in layers)}
    for kind in ("qkv", "o"):
        errors = [w.error[kind] for w in layers]
        out[f"error_{kind}"] = {"mean": round(sum(errors) / len(errors), 6),
                                "max": round(max(errors), 6)}
    return out


def dense_ffn_of(block) -> FeedForward:
    """The block's dense FFN, also when an earlier engine split it."""
    ffn = block.ffn
    if isinstance(ffn, HybridFFN):
        if ffn.source is None:
            raise RuntimeError("this model's FFN was split without keeping its dense weights")
        return ffn.source
    return ffn


def build_hybrid(model: Transformer, budget: int, gpu: torch.device, kv_pool_bytes: int,
                 split: str = "auto", cold_dtype: str = "fp32", preferred=None,
                 neuron_order=None, selectors: list[Selector | None] | None = None,
                 predictor_bytes: int = 0, choose=None,
                 tier: TierChoice | None = None) -> HybridModel:
    """Split the float32 model's FFN layers (`split_ffns`) and install them in its blocks:
    the legacy path, on a shared Transformer (`restore_dense` undoes it)."""
    restore_dense(model)
    dense = [dense_ffn_of(block) for block in model.blocks]
    hybrid = split_ffns(model.cfg, dense, budget, gpu, kv_pool_bytes, split, cold_dtype,
                        preferred, neuron_order, selectors, predictor_bytes, choose, tier=tier)
    for block, layer in zip(model.blocks, hybrid.layers):
        block.ffn = layer
    return hybrid


def split_ffns(cfg, ffns: list, budget: int, gpu: torch.device, kv_pool_bytes: int,
               split: str = "auto", cold_dtype: str = "fp32", preferred=None,
               neuron_order=None, selectors: list[Selector | None] | None = None,
               predictor_bytes: int = 0, choose=None,
               ungated: list[bool] | None = None, tier: TierChoice | None = None,
               attention_movable: bool = True, attention_dtype: torch.dtype | None = None,
               extras_movable: bool = True, need_attention: str | None = None,
               host_reads=None, release_file_pages: bool = False,
               attention_format: str | None = None, attention_bytes: int | None = None,
               lm_head_bytes: int | None = None,
               plan: MemoryPlan | None = None) -> HybridModel:
    """Plan `budget` bytes of GPU tier and split each FFN layer accordingly, touching nothing
    shared: `ffns` are per layer float FeedForwards or row sources (offload/body/ffn_rows.py, e.g.
    the file's blocks), read and left as they are. `ungated[i]`: layer i will get no
    selector, so with nothing hot it runs its dense twin and needs no cold bundles (None:
    every layer gets them, for callers that attach selectors later). `tier`: the hot rows'
    formats by file type (None: float32); `attention_movable` False: attention runs on the
    host's file blocks, so the tier holds FFN rows only; `attention_dtype`: the type the
    file-blocks runtime moves attention in (None: the float32 model's); `extras_movable`
    False: the LM head and predictors stay on the host. `need_attention`: the flag that
    asked for attention on the tier, an error (naming it) when the budget cannot hold it;
    `host_reads` (host_reads.HostReads): attention moves only where it pays.
    `release_file_pages`: a layer whose cold side holds the file's blocks (`--cold-dtype
    file`) lets the mapped file's pages of its FFN go once split (not for a copy in RAM).
    `attention_format`, `attention_bytes`, `lm_head_bytes`: the tier format attention and
    the LM head move in and their exact bytes (offload/body/tier_layers.py); without them
    the LM head is charged at fp32 (what the float32 model's GPU tier holds). `plan`: made
    already (the whole-model plan, file_plan.plan_file): the FFN layers are split by it and
    the sizing arguments are not used."""
    if cold_dtype not in COLD_CHOICES:
        raise ConfigError(f"unknown cold weight type {cold_dtype!r}; choose one of "
                          f"{', '.join(COLD_CHOICES)}")
    cold_dtype = resolve_cold_dtype(cold_dtype)
    if plan is None:
        formats = [tier_formats(tier, f) for f in ffns]
        sizes = ComponentBytes.estimate(cfg, kv_pool_bytes, lm_head=lm_head_bytes,
                                        predictors=predictor_bytes,
                                        formats=formats,
                                        half=torch.bfloat16 if tier is None else tier.half,
                                        attention_movable=attention_movable,
                                        attention_dtype=attention_dtype,
                                        extras_movable=extras_movable, host_reads=host_reads,
                                        attention_format=attention_format,
                                        attention=attention_bytes)
        plan = plan_memory(cfg, budget, sizes, split, preferred, neuron_order, choose)
    if need_attention and not plan.attention_on_gpu:
        _no_room_for_attention(plan, need_attention)
    worker = CpuWorker()
    layers, released = [], 0
    for i, ffn in enumerate(ffns):
        rows = as_rows(ffn)
        try:  # one layer's derived rows at a time (the file's down, made neuron-major)
            hybrid = HybridFFN.split(rows, i, plan.placement.hot[i], gpu, worker, cold_dtype,
                                     None if selectors is None else selectors[i],
                                     bundles=ungated is None or not ungated[i], tier=tier)
        finally:
            rows.release()
            # The split passed through float rows (the file's down dequantized: 180 MB a
            # layer on a 7B): freed, but glibc would keep that heap resident, layer after
            # layer, for the whole session.
            release_free_heap()
        if release_file_pages and hybrid.cold_file is not None and hybrid.hot is not None:
            # Both sides hold copies of the file's rows now: let the OS take back the mapped
            # pages, layer by layer (a reader who needs them again gets them from the file).
            released += sum(release_pages(t.raw) for t in (*rows.gate_up, rows.down))
        # A plain attribute, not a submodule: `.to(device)` never moves the dense twin.
        object.__setattr__(hybrid, "source", rows.dense)
        layers.append(hybrid)
    return HybridModel(plan, layers, worker, gpu, cold_dtype, file_bytes_released=released)


def _no_room_for_attention(plan: MemoryPlan, flag: str):
    from ember.models.support.sizes import format_size

    s = plan.sizes
    raise ConfigError(f"{flag} needs {format_size(s.attention + s.kv_pool)} of the GPU tier "
                      f"(attention {format_size(s.attention)} + KV pool "
                      f"{format_size(s.kv_pool)}) beside the working space "
                      f"{format_size(plan.workspace)}, but --gpu-budget is "
                      f"{format_size(plan.budget)}; raise it, lower --ctx-size or "
                      "--kv-budget, or use --tier-attention host")


def tier_formats(tier: TierChoice | None, ffn) -> tuple[str, str]:
    """(gate_up's, down's) tier format for one layer's FFN (float32 without a choice)."""
    return ("fp32", "fp32") if tier is None else tier.formats(*as_rows(ffn).types())


class HostLMHead(torch.nn.Module):
    """Keeps an LM head in host RAM when attention runs on a GPU the plan left it off."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: `.to()` must not move it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden.cpu()).to(hidden.device)


@dataclass(frozen=True)
class LayerPredictors:
    """Per layer a `predict(x) -> (T, ffn) bool` callable or None (the layer runs dense)."""

    predict: list
    nbytes: int


def profile_predictors(profile, cfg) -> LayerPredictors:
    """The profile's predictors, validated against the model's sizes."""
    from ember.predictors.mlp import PredictorSet

    tensors = profile.predictor_tensors
    if not tensors:
        return LayerPredictors([None] * cfg.n_layers, 0)
    found = PredictorSet.from_tensors(tensors, cfg.n_layers, cfg.hidden_size, cfg.ffn_size,
                                      source="profile artifact")
    return LayerPredictors([None if p is None else p.predict for p in found.predictors],
                           sum(p.nbytes for p in found.predictors if p is not None))


def profile_chooser(profile, predictors: LayerPredictors | None, sparse: bool, cfg):
    """room -> Placement solved from the profile's statistics and measured costs (None when
    the profile has no costs: its own placement is then cut to the room hottest-first)."""
    from .side_costs import SideCosts
    from .placement_solver import chooser

    if "costs" not in profile.meta:
        return None
    try:
        costs = SideCosts.from_dict(profile.meta["costs"])
    except (KeyError, TypeError, ValueError):
        from ember.models.support.errors import ModelFormatError

        raise ModelFormatError("profile artifact", "its 'costs' entry is malformed; run "
                               "`ember profile` again") from None
    dense = [not sparse or predictors is None or p is None
             for p in (predictors.predict if predictors else [None] * profile.n_layers)]
    neuron = neuron_bytes(cfg.hidden_size, cfg.gated)
    return chooser(profile.frequency, dense, [neuron] * profile.n_layers, costs)


def attach_predictors(hybrid: HybridModel, predictors: LayerPredictors,
                      bias: list | None = None) -> None:
    """Gate each layer's cold side by its predictor (layers without one stay dense), with
    the layer's compensation bias (GLU models) where the profile has one."""
    from .neuron_selectors import PredictorSelector

    for i, (layer, predict) in enumerate(zip(hybrid.layers, predictors.predict)):
        if predict is not None and layer.cold is not None:
            layer.selector = PredictorSelector(predict, torch.from_numpy(layer.cold_idx))
            layer.bias = bias[i] if bias and i < len(bias) else None


def restore_dense(model: Transformer) -> None:
    """Undo an earlier engine's split: dense FFN modules and the plain LM head back."""
    if isinstance(model.head, HostLMHead):
        model.head = model.head.inner
    for block in model.blocks:
        block.ffn = dense_ffn_of(block)
