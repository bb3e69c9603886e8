"""Will the model fit? Checked before anything large is built, so a model too big for this
machine is a clear error with the numbers instead of an OOM kill halfway through loading.

Needed: the weights as the engine will hold them (the file's own bytes, mapped or in RAM, when
it runs on the file's blocks, plus the FFN rows a hybrid split derives from them; 4 bytes a
parameter when it builds the float32 model: `--weights fp32/q8`, a GPU device), the KV pools
the engine will allocate (`plan_kv`: the device pool and the host pool for swapped-out
conversations), and a fixed allowance for the runtime. On a CUDA device the weights and the
device pool must also fit in free GPU memory; host RAM still holds the fp32 weights while
they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from ember.models import ram_copy
from ember.models.support.errors import EmberError
from ember.models.loader import ModelSource
from ember.models.summary import summarize

from .device import resolve_device
from .engine_model import kv_value_bytes
from .profile_file import default_profile_path, thresholds_inputs
from ..kv.plan import plan_kv
from ..body.file_blocks_model import runs_on_file_blocks

GIB = 1 << 30
# Activations, logits, torch's own buffers and the tokenizer: well under this for the default
# model; a model that fits only without it would be swapped or killed anyway.
RUNTIME_ALLOWANCE = 256 << 20


class InsufficientMemoryError(EmberError):
    """The model and its KV cache need more memory than this machine has free."""


def memory_check(options) -> Callable[[ModelSource], None]:
    """For `load_model(path, check=...)`: raises before the weights are built if they and the
    KV pools of `options` (an EngineOptions) cannot fit."""
    return lambda source: check_memory(source, options, resolve_device(options.device))


@dataclass(frozen=True)
class ContextSize:
    """The context an engine gets, and what set it: "asked" (--ctx-size), "model" (the
    model's trained length: the default, or less than what was asked) or "memory" (the
    default, capped so the KV pools fit in the RAM the weights leave)."""

    tokens: int
    limit: str

    def describe(self) -> str:
        return {"asked": "as asked (--ctx-size)", "model": "the model's trained length",
                "memory": "capped by free RAM (the model was trained for more; --ctx-size "
                          "asks for another)"}[self.limit]


# The default context may give the KV pools (one full context on the device, one more in
# host RAM for idle conversations) at most this share of the RAM the weights leave free.
KV_RAM_SHARE = 0.5
CONTEXT_STEP = 256  # a capped default context is a multiple of this


def context_size(source: ModelSource, options, device: torch.device,
                 available: int | None = None) -> ContextSize:
    """The context for the options' `n_ctx` (None: the model's trained length, capped by
    memory)."""
    cfg = source.config
    if options.n_ctx is not None:
        return ContextSize(min(options.n_ctx, cfg.context_length),
                           "asked" if options.n_ctx <= cfg.context_length else "model")
    free = psutil.virtual_memory().available if available is None else available
    room = KV_RAM_SHARE * (free - _weights_held(source, options, device)[0] - RUNTIME_ALLOWANCE)
    value_bytes = kv_value_bytes(options, device)

    def fits(n: int) -> bool:
        # Pools sized by the context are counted against the room; one given in bytes
        # (--kv-budget, --kv-host-budget) is the user's call, but must hold one context.
        need = plan_kv(cfg, n, None, None, options.kv_block_size, value_bytes)
        one_context = need.min_device_blocks * need.block_bytes
        if options.kv_budget is not None and options.kv_budget < one_context:
            return False
        counted = (options.kv_budget is None) + (options.kv_host_budget is None)
        return counted * one_context <= room
    if fits(cfg.context_length):
        return ContextSize(cfg.context_length, "model")
    lo, hi = 0, cfg.context_length // CONTEXT_STEP  # the most steps that fit, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * CONTEXT_STEP) else (lo, mid - 1)
    # Too little even for one step: the smallest, which the memory check then refuses
    # with the numbers.
    return ContextSize(min(max(lo, 1) * CONTEXT_STEP, cfg.context_length), "memory")


def _weights_held(source: ModelSource, options, device: torch.device) -> tuple[int, str]:
    """Host bytes the weights take as the engine will hold them, and how they are held."""
    memory = summarize(source, 1)["memory"]  # the weights do not depend on the context
    if builds_float_model(source, options, device):
        return memory["weights_fp32_bytes"], "as fp32"
    weights, held = memory["weights_bytes"], "as stored in the file"
    split = split_rows_bytes(source, options, device)
    if split:
        weights += split
        held += f" + {split / GIB:.2f} GiB of FFN rows the hybrid split derives"
    return weights, held


def check_memory(source: ModelSource, options, device: torch.device) -> None:
    cfg = source.config
    n_ctx = context_size(source, options, device).tokens
    pools = plan_kv(cfg, n_ctx, options.kv_budget, options.kv_host_budget,
                    options.kv_block_size, kv_value_bytes(options, device)).to_dict()
    weights, held = _weights_held(source, options, device)
    device_kv, host_kv = pools["device_bytes"], pools["host_bytes"]
    on_gpu = device.type == "cuda"
    # The file-blocks runtime keeps its KV pool in host RAM unless attention is sent to the
    # tier by name (`auto` may leave it on the host: counted there, to be safe).
    kv_on_gpu = on_gpu and (builds_float_model(source, options, device)
                            or getattr(options, "tier_attention", "auto") not in ("auto", "host"))
    host_need = weights + host_kv + (0 if kv_on_gpu else device_kv) + RUNTIME_ALLOWANCE
    detail = (f"weights {weights / GIB:.2f} GiB {held}, KV cache {device_kv / GIB:.2f} GiB "
              f"for {n_ctx} tokens + {host_kv / GIB:.2f} GiB swap pool")
    _require("RAM", host_need, psutil.virtual_memory().available, detail)
    if on_gpu:
        free, _total = torch.cuda.mem_get_info(device)
        budget = getattr(options, "gpu_budget", None)
        if budget is not None:  # hybrid: the memory plan keeps the GPU tier within the budget
            _require(f"GPU memory on {device}", budget, free,
                     f"--gpu-budget {budget / GIB:.2f} GiB; lower it to what the GPU has free")
        else:
            _require(f"GPU memory on {device}", weights + device_kv, free, detail)


def splits_ffns(source: ModelSource, options) -> bool:
    """Whether an engine with `options` splits its FFNs: a GPU-tier budget or split, or a
    predictor profile, given or found for this model (an input-threshold profile runs on the
    unsplit model)."""
    return (options.gpu_budget is not None or options.split != "auto"
            or gated_by_predictors(source, options))


def gated_by_predictors(source: ModelSource, options) -> bool:
    """Whether the engine's profile (given or found) may gate neurons by predictors, whose
    layers keep int8 bundles on their cold side whatever --cold-dtype says."""
    profile = _profile_path(source, options)
    return profile is not None and thresholds_inputs(profile) is not True


def _profile_path(source: ModelSource, options):
    profile = options.profile
    if profile == "auto":
        found = default_profile_path(source.fingerprint)
        return found if found.is_file() else None
    return profile


# `--mmap auto` copies the file into RAM only when it takes at most this share of the RAM
# available: a copy cannot be dropped and re-read under memory pressure as mapped pages can,
# so a model near the size of free RAM stays mapped (~7% slower decode, but it runs).
RAM_COPY_SHARE = 0.6


def weights_in_ram(options) -> Callable[[ModelSource], bool]:
    """For `load_model(path, in_ram=...)`: whether an engine with `options` (EngineOptions)
    reads the file's bytes into RAM (models/ram_copy.py) instead of using the map."""
    device = resolve_device(options.device)
    return lambda source: reads_weights_into_ram(source, options, device)


def reads_weights_into_ram(source: ModelSource, options, device: torch.device,
                           available: int | None = None) -> bool:
    if options.mmap == "on" or builds_float_model(source, options, device):
        return False  # an engine that builds float weights reads the file once: no gain
    if not ram_copy.supported():
        return False  # this platform maps the file whatever was asked
    if options.mmap == "off":
        return True
    if splits_ffns(source, options):
        return False  # the split's own rows replace the FFN tensors: mapped, they are never read
    free = psutil.virtual_memory().available if available is None else available
    return source.weights.total_bytes() <= RAM_COPY_SHARE * free


def builds_float_model(source: ModelSource, options, device: torch.device) -> bool:
    """Whether an engine with `options` builds the float32 model instead of running on the
    file's blocks (see Engine.__init__); a hybrid split on the file's blocks does not."""
    return not runs_on_file_blocks(options, device)


FFN_MATRICES = (".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight")


def split_rows_bytes(source: ModelSource, options, device: torch.device) -> int:
    """Host RAM a hybrid split on the file's blocks adds, at most: every neuron's cold bundle
    (derived rows, memory_plan.cold_neuron_bytes; with --cold-dtype file, the file's FFN
    bytes: its cold rows copied and its down as tiles) plus, when the GPU tier is this CPU, its
    hot rows (within --gpu-budget; bounded by float32 rows), or the whole budget when
    `--tier-attention` puts attention there too. 0 without a split."""
    from ..hybrid.ffn import bundle_dtype
    from ..hybrid.setup import resolve_cold_dtype
    from ..hybrid.memory_plan import cold_neuron_bytes, neuron_bytes

    if not splits_ffns(source, options):
        return 0
    cfg = source.config
    neurons = cfg.n_layers * cfg.ffn_size
    cold_dtype = resolve_cold_dtype(options.cold_dtype, options.weights)
    if cold_dtype == "file" and cfg.gated and not gated_by_predictors(source, options):
        # the file's gate/up rows and down tiles
        cold = sum(source.weights.get(n).nbytes for n in source.weights.names()
                   if n.startswith("blk.") and n.endswith(FFN_MATRICES))
    else:  # bundles ("file" falls back to int8 ones on a plain MLP or under predictors)
        cold = neurons * cold_neuron_bytes(cfg.hidden_size, cfg.gated, bundle_dtype(cold_dtype))
    hot = 0
    if device.type == "cpu" and options.gpu_budget is not None:
        hot = min(options.gpu_budget, neurons * neuron_bytes(cfg.hidden_size, cfg.gated))
        if getattr(options, "tier_attention", "auto") not in ("auto", "host"):
            hot = options.gpu_budget  # attention's copies and its KV pool share the budget
    return cold + hot


def _require(what: str, need: int, available: int, detail: str) -> None:
    if need > available:
        raise InsufficientMemoryError(
            f"the model needs {need / GIB:.2f} GiB of {what} ({detail}) but only "
            f"{available / GIB:.2f} GiB is available; try a smaller --ctx-size or a smaller model")
