"""Building the drafter `EngineOptions.speculate` asks for, with its default tree."""

from __future__ import annotations

import torch

from ember.models.errors import ConfigError

from .drafters import LookupDrafter, ModelDrafter, SelfDrafter, check_same_tokenizer
from ..options.tree_spec import parse_tree

# Default expansions (the tree sizer shrinks them while drafts are rejected). Chains: on a
# CPU every drafted node costs a body pass (self) or a verified row, and the self-drafter's
# top-1 agrees with the target ~99% of the time on the default model.
DEFAULT_TREES = {"self": "1,1,1,1,1,1,1", "lookup": "1,1,1,1,1,1,1,1,1,1,1,1",
                 "model": "1,1,1,1,1,1"}


def make_drafter(engine, options):
    """(drafter or None, tree widths) for the engine's options."""
    if options.speculate == "off":
        return None, ()
    widths = parse_tree(options.tree or DEFAULT_TREES[options.speculate])
    if options.speculate == "self":
        return SelfDrafter(engine.model), widths
    if options.speculate == "lookup":
        return LookupDrafter(), widths
    return ModelDrafter(_draft_runner(engine, options.draft_model)), widths


def _draft_runner(engine, path: str):
    from ember.models.loader import load_model

    from ..body import file_blocks_model
    from ..kv.plan import DEFAULT_ROLLBACK_MARGIN, plan_kv
    from ..kv.paged import PagedKVCache
    from ..decode.runner import Runner

    try:
        loaded = load_model(path)
    except FileNotFoundError:
        raise ConfigError(f"--draft-model {path}: no such file or folder") from None
    check_same_tokenizer(engine.tokenizer, loaded.tokenizer, path)
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
