"""The model engines run: the file's own blocks (offload/body/file_blocks_model.py), against the float32
reference Transformer, and as an engine's private model."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import decoder_step
from ember.models.reference_cache import ContiguousKVCache
from ember.models.loader import load_model, open_model
from ember.models.tree_rows import TreeRows
from ember.offload.body import file_blocks_model, file_layers
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.offload.options.sampling import GREEDY

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]

needs_native = pytest.mark.skipif(not file_blocks_model.applies(),
                                  reason="C++ kernels not built on this machine")


def _logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, one prefill."""
    cache = ContiguousKVCache(model.cfg, 64)
    return model.logits(model.hidden(torch.tensor(ids), cache))


@pytest.mark.parametrize("name", ["gemma3", "llama-silu_glu", "llama-relu"])
def test_float_files_match_the_reference_model(tiny_models, name):
    """F32 files: the kernels multiply float weights by float activations, so the logits
    agree with the reference to float rounding."""
    path = tiny_models[name][2]
    loaded = load_model(path)
    ours = _logits(FileBlocksModel.plain(loaded.source), PROMPT)
    ref = _logits(loaded.model, PROMPT)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_k_quant_file_matches_the_reference_model(tiny_q4_k_m):
    """Q4_K/Q6_K blocks read natively: activations are rounded to int8 per block (as
    llama.cpp does), which costs a little against the dequantized float reference."""
    loaded = load_model(tiny_q4_k_m[2])
    ours = _logits(FileBlocksModel.plain(loaded.source), PROMPT)
    ref = _logits(loaded.model, PROMPT)
    # Each matmul is ~0.6% off (of its largest output) with int8 activations; this random
    # model's sharp attention amplifies that over its layers (the default model's perplexity,
    # checked in test_default_model, is the real measure of the loss).
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < 0.3, f"relative logit error {err:.4f}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.75


def test_the_model_is_built_from_the_file_without_a_float_copy(tiny_q4_k_m):
    source = open_model(tiny_q4_k_m[2])
    model = FileBlocksModel.plain(source)
    layer = model.layers[0]
    # The projections are the file's own tensors (views of the mapping), not copies.
    assert layer.qkv[0] is source.weights.get("blk.0.attn_q.weight")
    assert layer.down is source.weights.get("blk.0.ffn_down.weight")
    assert model.derived == {}
    assert model.weight_bytes_per_token() == file_layers.file_bytes_per_token(
        source.config, source.weights)


def test_a_decoded_token_gives_the_bits_prefill_gives(tiny_q4_k_m):
    """Rows are computed alone whatever T is: prefill of n tokens and prefill of n-1 then one
    decode step produce the very same last logits."""
    model = FileBlocksModel.plain(open_model(tiny_q4_k_m[2]))
    whole = _logits(model, PROMPT)[-1]
    cache = ContiguousKVCache(model.cfg, 64)
    model.hidden(torch.tensor(PROMPT[:-1]), cache)
    step = model.logits(model.hidden(torch.tensor(PROMPT[-1:]), cache))[0]
    assert torch.equal(whole, step)


def test_tree_rows_match_plain_decoding(tiny_q4_k_m):
    """Two tree rows (a root and its child) verified in one pass give the bits of decoding
    them one after the other."""
    model = FileBlocksModel.plain(open_model(tiny_q4_k_m[2]))
    ctx, a, b = PROMPT[:-2], PROMPT[-2], PROMPT[-1]
    cache = ContiguousKVCache(model.cfg, 64)
    model.hidden(torch.tensor(ctx), cache)
    n = len(ctx)
    cache.reserve(2)
    tree = TreeRows(context=n, first=0, positions=torch.tensor([n, n + 1]),
                    keys=torch.tensor([0, 1]), key_positions=torch.tensor([n, n + 1]),
                    mask=torch.tensor([[True, False], [True, True]]))
    rows = model.logits(model.hidden(torch.tensor([a, b]), cache, tree))
    plain = ContiguousKVCache(model.cfg, 64)
    model.hidden(torch.tensor(ctx), plain)
    first = model.logits(model.hidden(torch.tensor([a]), plain))
    second = model.logits(model.hidden(torch.tensor([b]), plain))
    assert torch.equal(rows, torch.cat([first, second]))


@pytest.mark.skipif(not decoder_step.available(), reason="C++ kernels not built")
def test_one_call_matches_its_python_chain(tiny_models, tiny_q4_k_m):
    """kernels.decoder_step's C++ DecoderStep against decoder_step_reference, bit for bit,
    for a gemma3 file (q/k norms, sandwich norms, windows) and a K-quant llama."""
    for path in (tiny_models["gemma3"][2], tiny_q4_k_m[2]):
        model = FileBlocksModel.plain(open_model(path))
        native = _logits(model, PROMPT)
        model.whole.run = lambda *args: decoder_step.decoder_step_reference(model.layers, *args)
        assert torch.equal(native, _logits(model, PROMPT))


@needs_native
def test_an_engine_runs_on_the_file_blocks_and_never_builds_the_float_model(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    assert isinstance(engine.model, FileBlocksModel) and engine.weights == "native"
    engine.generate(PROMPT, sampling=GREEDY, max_tokens=4, ignore_eos=True)
    assert loaded._model is None  # the float32 model was never built
    # its KV cache in half precision, planned at 2 bytes a value; the float32 reference's in float32
    assert engine.kv.device_pool.k.dtype == torch.float16 == engine.kv.host_pool.v.dtype
    cfg, plan = loaded.config, engine.kv_plan
    assert plan.block_bytes == 2 * plan.block_size * cfg.n_kv_heads * cfg.head_dim * 2
    reference = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, weights="fp32"))
    assert reference.kv.device_pool.k.dtype == torch.float32


@needs_native
def test_two_engines_on_one_file_are_independent(tiny_q4_k_m):
    """An engine made later with other options (the float32 body, speculation) leaves the
    first one's model and output alone."""
    loaded = load_model(tiny_q4_k_m[2])
    first = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    before = first.generate(PROMPT, sampling=GREEDY, max_tokens=6, ignore_eos=True).token_ids
    model = first.model
    second = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, weights="fp32"))
    third = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, speculate="self"))
    assert first.model is model and second.model is not model and third.model is not model
    first.runner.reset("default")
    after = first.generate(PROMPT, sampling=GREEDY, max_tokens=6, ignore_eos=True).token_ids
    assert after == before
    spec = third.generate(PROMPT, sampling=GREEDY, max_tokens=6, ignore_eos=True).token_ids
    assert spec == before  # speculation is lossless on the file-blocks model too
