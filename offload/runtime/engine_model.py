"""The model an engine runs, built from its options: the file's own blocks or the float32
reference, its FFN layers split into a GPU tier and a host side when a budget or a profile
asks for it, and a profile's predictors or input thresholds applied."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ember.models.support.errors import ConfigError
from ember.models.loader import LoadedModel

from ..body.file_blocks_model import FileBlocksModel, kv_dtype, runs_on_file_blocks
from ..body.file_blocks_model import kv_value_bytes as value_bytes
from ..body.file_layers import FileLayers
from ..body.input_sparsity import apply_input_sparsity
from ..body.protocol import BodyModel
from ..body.tier_layers import tier_attention_bytes, tier_head_bytes
from ..hybrid.setup import (UNLIMITED, HostLMHead, HybridModel, attach_predictors, build_hybrid,
                            profile_chooser, profile_predictors, resolve_cold_dtype,
                            restore_dense, split_ffns)
from ..hybrid.host_reads import HostReads
from ..hybrid.file_plan import plan_file, plans_whole_model
from ..hybrid.placed_model import build_placed_model
from ..hybrid.tier_dtypes import (TierCaps, TierChoice, attention_format, attention_kv_dtype,
                                  tier_kv_dtype)
from ..kv.plan import KVPlan
from ..options.choices import FILE
from ..options.engine_options import EngineOptions
from .profile_file import default_profile_path, load_profile


@dataclass
class EngineModel:
    model: BodyModel  # what the Runner drives: a FileBlocksModel or the float32 Transformer
    compute: torch.device  # where attention and its KV cache run
    kv_dtype: torch.dtype  # what its KV cache holds
    weights: str  # the body's weights: "native" (the file's blocks) or "fp32"
    lm_head: str  # the LM head's kind: "fp32", or the GGML type name of the file's head
    hybrid: HybridModel | None  # the FFN split, None when the FFNs are whole
    input_sparsity: object | None  # a profile's input thresholds, when applied
    profile_path: str | Path | None
    profile_quality: dict | None  # what the profile's end-to-end check measured
    # (layers, dtype): layers whose attention runs on the host beside a device tier, their
    # K/V in host RAM in that type (None: every layer's K/V at `compute` in `kv_dtype`)
    host_kv: tuple[tuple[int, ...], torch.dtype] | None = None


def build_engine_model(loaded: LoadedModel, options: EngineOptions, device: torch.device,
                       kv_plan: KVPlan, n_ctx: int) -> EngineModel:
    """Build the body for `options` on `device` and a context of `n_ctx` tokens; `kv_plan`
    says what the KV pool takes of a GPU tier."""
    # The file's own blocks, read for this engine (nothing shared is rewired); a hybrid
    # split slices its FFN rows from them too, and the model is built once over both.
    file = FileLayers.read(loaded.source) if runs_on_file_blocks(options, device) else None
    profile, path = _find_profile(loaded, options)
    quality = None if profile is None else _profile_quality(profile)
    input_sparsity, hybrid = None, None
    thresholded = use_input_thresholds(profile, file, options)
    if thresholded and options.gpu_budget is None:
        # GLU models: the profile thresholds matmul inputs rather than predicting neurons
        blocks = FileBlocksModel(file, kv=(torch.device("cpu"), kv_dtype(options, device)))
        input_sparsity = _threshold_inputs(blocks, applied_thresholds(profile, options), profile)
    else:
        hybrid = _split_ffn(loaded, options, device, kv_plan, n_ctx, profile, file)
        if thresholded and hybrid is not None:
            _threshold_split(hybrid, profile)
        blocks = None if file is None else _file_blocks_model(file, hybrid, options, device)
    if blocks is not None:
        head = file.head.qtype_name.lower()
        return EngineModel(blocks, blocks.attention_device, blocks.kv_dtype, "native", head,
                           hybrid, input_sparsity, path, quality, blocks.kv_host_layers)
    compute = device if hybrid is None else hybrid.attention_device
    model = _float_model(loaded, compute, hybrid)
    return EngineModel(model, compute, torch.float32, "fp32", "fp32", hybrid, input_sparsity,
                       path, quality)


def _file_blocks_model(file: FileLayers, hybrid: HybridModel | None, options: EngineOptions,
                       device: torch.device) -> FileBlocksModel:
    """The model over the file's layers, each run where the split's plan put it."""
    if hybrid is None:
        return FileBlocksModel(file, kv=(torch.device("cpu"), kv_dtype(options, device)))
    fmt = _attention_format(options, device)
    return build_placed_model(file, hybrid, fmt, TierCaps.of(device).half,
                              kv_dtype(options, device))


def _attention_format(options: EngineOptions, device: torch.device) -> str | None:
    """The tier format attention and the LM head may take (None: no tier, or
    `--tier-attention host`)."""
    if options.gpu_budget is None:
        return None
    return attention_format(options.tier_attention, device)


def kv_value_bytes(options: EngineOptions, device: torch.device) -> float:
    """Bytes per K/V value the KV plan is sized (and the tier charged) by: those of the pool
    tier layers' K/V are built in where attention can move to a tier
    (tier_dtypes.tier_kv_dtype: a CUDA tier's float16 even under --kv-type q8_0), else the
    runtime's own (--kv-type on the file's blocks)."""
    host = kv_dtype(options, device)
    choice = options.tier_attention
    if options.gpu_budget is None or choice == "host" or not runs_on_file_blocks(options,
                                                                                   device):
        return value_bytes(host)
    # auto: the file's blocks (known without asking the device what it can do)
    fmt = FILE if choice == "auto" else attention_format(choice, device)
    return value_bytes(tier_kv_dtype(fmt, device, host))


def _float_model(loaded: LoadedModel, compute: torch.device, hybrid: HybridModel | None):
    """The shared float32 Transformer, op by op in PyTorch: the path for `--weights fp32`
    and a GPU device (split or not)."""
    if hybrid is None:
        restore_dense(loaded.model)
    model = loaded.model.to(compute)
    if hybrid is not None and compute.type != "cpu" and not hybrid.plan.lm_head_on_gpu:
        model.head = HostLMHead(model.head)
    return model


def _find_profile(loaded: LoadedModel, options: EngineOptions):
    """(profile, its path), both None when the options name none."""
    path = options.profile
    if path == "auto":  # the one `ember profile` wrote for this model, if any
        found = default_profile_path(loaded.source.fingerprint)
        path = found if found.is_file() else None
        if path is None and options.ffn_mode == "sparse":
            raise ConfigError(f"--ffn-mode sparse needs a profile and there is none at "
                              f"{found}; run `ember profile` first")
    if path is None:
        return None, None
    return load_profile(path, loaded.config, loaded.source.fingerprint), path


def _split_ffn(loaded: LoadedModel, options: EngineOptions, device: torch.device,
               kv_plan: KVPlan, n_ctx: int, profile,
               blocks: FileLayers | None) -> HybridModel | None:
    """Split FFN layers by the GPU-tier plan (None: no split): rows from the file's
    `blocks` when the engine runs on them, else from the float32 model's FFNs."""
    if options.gpu_budget is None and options.split == "auto" and profile is None:
        return None
    kv_bytes = kv_plan.device_blocks * kv_plan.block_bytes
    if options.gpu_budget is None:  # a profile alone: sparse on the host, no GPU tier
        budget, split = UNLIMITED, "cpu-only"
    else:
        budget, split = options.gpu_budget, options.split
    predictors = None if profile is None else profile_predictors(profile, loaded.config)
    sparse = predictors is not None and options.ffn_mode != "dense"
    how = dict(
        tier=TierChoice.resolve(options.tier_dtype, device),
        split=split, cold_dtype=resolve_cold_dtype(options.cold_dtype, options.weights),
        preferred=None if profile is None else profile.placement,
        neuron_order=None if profile is None else profile.neuron_order(),
        predictor_bytes=0 if predictors is None else predictors.nbytes,
        choose=None if profile is None else profile_chooser(profile, predictors, sparse,
                                                            loaded.config))
    if blocks is not None:
        # Layers no predictor gates compute every cold neuron: with nothing hot they run
        # on the file's blocks, with no bundles derived.
        gates = predictors.predict if sparse else [None] * len(blocks.layers)
        # Attention, its KV and the LM head move to the tier in the file's blocks (or the
        # format `--tier-attention` names) where the plan puts them: when asked, or when the
        # budget holds them and that spares the host the most reads; else they run on the
        # blocks in host RAM. The predictors stay on the host.
        fmt = _attention_format(options, device)
        named = options.tier_attention not in ("auto", "host")
        moved = {}
        if fmt is not None and plans_whole_model(options.tier_attention, options.tier_dtype):
            # every tensor in the file's bytes, per layer "gpu", "split" or "cpu": the plan
            # `ember info --gpu-budget` shows, made by the same call
            how["plan"] = plan_file(loaded.config, loaded.source.weights, budget, n_ctx,
                                    kv_bytes, split, options.gpu, device, how["neuron_order"],
                                    _activity(profile, predictors) if sparse else None,
                                    kv_layers=kv_plan.layer_bytes())
        elif fmt is not None:  # the plan of FFN rows, attention moving whole or not at all
            if not named:
                how["host_reads"] = HostReads.of_file(loaded.config, loaded.source.weights,
                                                      n_ctx)
            half = how["tier"].half
            moved = dict(attention_format=fmt,
                         attention_bytes=tier_attention_bytes(blocks, fmt, half),
                         lm_head_bytes=tier_head_bytes(blocks, fmt, half))
        how["predictor_bytes"] = 0  # the file-blocks runtime runs them on the host
        hybrid = split_ffns(loaded.config, blocks.ffn_rows(), budget, device,
                            kv_bytes, ungated=[g is None for g in gates],
                            attention_movable=fmt is not None,
                            attention_dtype=None if fmt is None else attention_kv_dtype(fmt),
                            need_attention=f"--tier-attention {options.tier_attention}"
                            if named else None,
                            # only a map's pages: a copy's would read as zeros
                            release_file_pages=getattr(blocks.weights, "mapped", False),
                            **moved, **how)
    else:
        hybrid = build_hybrid(loaded.model, budget, device, kv_bytes, **how)
    if sparse:
        attach_predictors(hybrid, predictors, profile.bias)
    return hybrid


def _activity(profile, predictors) -> list:
    """Per layer each neuron's firing frequency in the profile's calibration where a
    predictor lets the host skip cold neurons (None: the layer runs dense), as the
    whole-model plan prices it."""
    return [None if p is None else f.numpy()
            for f, p in zip(profile.frequency, predictors.predict)]


def use_input_thresholds(profile, blocks, options) -> bool:
    """A profile with input thresholds runs them on the file-blocks runtime unless the FFNs
    are forced dense; with a GPU tier they compose with the split (`_threshold_split`)."""
    return (profile is not None and blocks is not None and "input_thresholds" in profile.meta
            and options.ffn_mode != "dense")


def _threshold_inputs(blocks: FileBlocksModel, thresholds, profile):
    """Run `thresholds` on the host's input-major tiles."""
    runtime = apply_input_sparsity(blocks, thresholds, profile.meta.get("input_layout", "tiles"))
    # the engine's thresholds are fixed: the tiles replace the file's copies of those matmuls,
    # which need not stay resident beside them
    runtime.release_file_copies()
    return runtime


def _threshold_split(hybrid: HybridModel, profile) -> None:
    """Input thresholds beside a GPU-tier split (issue 18): each split layer's cold side
    takes its down threshold and skips the down rows of the cold neurons it drops. It always
    applies (whatever `input_pays` says of the host's matmuls): on bundles the skip happens
    inside each neuron's one stream, and the file cold side reads its down tiles input-sparse
    anyway (the hot inputs are skipped), so either way it only removes reads and work.
    Layers with nothing hot run dense on the file's blocks; attention's slots stay dense (a
    split model runs attention through its own C++ call, which has no thresholded matmuls
    yet)."""
    for layer, slots in zip(hybrid.layers, profile.meta["input_thresholds"]):
        if slots.get("down") is not None and layer.has_cold_side and layer.hot is not None \
                and layer.selector is None:
            layer.down_threshold = float(slots["down"])


def applied_thresholds(profile, options) -> list[dict[str, float]]:
    """The profile's input thresholds an engine applies: with `--ffn-mode auto`, only the slots
    its timing found to pay on the machine that profiled (`input_pays`; profiles made before
    it apply every slot), with `--ffn-mode sparse` all of them."""
    thresholds = profile.meta["input_thresholds"]
    pays = profile.meta.get("input_pays")
    if options.ffn_mode == "sparse" or pays is None:
        return thresholds
    return [{s: v for s, v in layer.items() if s in pays} for layer in thresholds]


def _profile_quality(profile) -> dict:
    """What `ember profile`'s end-to-end check measured against the dense model (held-out
    perplexity ratio, top-1 and greedy agreement), with the budget it was held to."""
    meta = profile.meta
    return {"quality_budget": meta.get("quality_budget"), "recall": meta.get("recall_used"),
            "check": (meta.get("report") or {}).get("quality")}
