"""Building the drafter `EngineOptions.speculate` asks for, with its default tree."""

from __future__ import annotations

import logging

import torch

from ember.models.support.errors import ConfigError, EmberError

from .draft_choice import find_draft_model
from .drafters import LookupDrafter, SelfDrafter
from .model_drafter import CombinedDrafter, ModelDrafter, check_same_tokenizer
from ..options.tree_spec import parse_tree

log = logging.getLogger("ember")

# Default expansions (the tree sizer shrinks them while drafts are rejected). Chains: on a
# CPU every drafted node costs a body pass (self) or a verified row, and the self-drafter's
# top-1 agrees with the target ~99% of the time on the default model.
DEFAULT_TREES = {"self": "1,1,1,1,1,1,1", "lookup": "1,1,1,1,1,1,1,1,1,1,1,1",
                 "model": "1,1,1,1,1,1"}


def make_drafter(engine, options):
    """(drafter or None, tree widths) for the engine's options."""
    mode, draft = options.speculate, None
    if mode == "auto":
        mode, draft = _auto_choice(engine)
    if mode == "off":
        return None, ()
    widths = parse_tree(options.tree or DEFAULT_TREES[mode])
    if mode == "self":
        return SelfDrafter(engine.model), widths
    if mode == "lookup":
        return LookupDrafter(), widths
    draft = draft or _load_draft(engine, options.draft_model)
    model = ModelDrafter(_draft_runner(engine, draft), tuple(engine.stop_ids))
    return CombinedDrafter(model, LookupDrafter()), widths


def _auto_choice(engine):
    """`--speculate auto`: (mode, the loaded draft model or None). A draft tree is verified
    in one pass only by a batch-invariant body; otherwise each node costs a step and
    nothing pays."""
    if not engine.model.batch_invariant:
        return "off", None
    path = find_draft_model(engine.loaded.source.path)
    if path is None:
        return "lookup", None
    try:
        draft = _load_draft(engine, str(path))
    except EmberError as e:
        log.warning("ember: --speculate auto: not drafting with %s (%s)", path, e)
        return "lookup", None
    log.info("ember: --speculate auto drafts with %s", path)
    return "model", draft


def _load_draft(engine, path: str):
    from ember.models.loader import load_model

    try:
        loaded = load_model(path)
    except FileNotFoundError:
        raise ConfigError(f"--draft-model {path}: no such file or folder") from None
    check_same_tokenizer(engine.tokenizer, loaded.tokenizer, path)
    return loaded


def _draft_runner(engine, loaded):
    from ..body import file_blocks_model
    from ..kv.plan import DEFAULT_ROLLBACK_MARGIN, plan_kv
    from ..kv.paged import PagedKVCache
    from ..decode.runner import Runner

    device = engine.model.device
    if device.type == "cpu" and file_blocks_model.applies():  # the draft's own file blocks
        model = file_blocks_model.FileBlocksModel.plain(loaded.source)
    else:  # the float32 model, op by op (a GPU device, or no C++ kernels)
        model = loaded.model.to(device)
    n_ctx = min(engine.n_ctx, loaded.config.context_length)
    dtype = getattr(model, "kv_dtype", torch.float32)  # what the draft model's attention reads
    plan = plan_kv(loaded.config, n_ctx, None, 0, engine.kv_plan.block_size, dtype.itemsize)
    kv = PagedKVCache(loaded.config, plan.device_blocks, plan.host_blocks, plan.block_size,
                      engine.model.device, DEFAULT_ROLLBACK_MARGIN, dtype)
    return Runner(model, kv, n_ctx)
