"""`--kv-type q8_0` and `bf16`: the KV cache as Q8_0 blocks or bfloat16 through the paged pool,
swap, the plan's bytes, `ember info`, and the file-blocks step against its Python chain."""

from __future__ import annotations

import json

import pytest
import torch

from ember.app import cli
from ember.kernels import decoder_step
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model, open_model
from ember.offload.body import file_blocks_model
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.offload.body.file_layers import FileLayers
from ember.offload.options.sampling import GREEDY
from ember.offload.kv.paged import PagedKVCache
from ember.offload.runtime.engine import Engine, EngineOptions

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]
needs_native = pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")


def _model(tiny_q4_k_m, kv_dtype: torch.dtype) -> FileBlocksModel:
    return FileBlocksModel(FileLayers.read(open_model(tiny_q4_k_m[2])),
                           kv=(torch.device("cpu"), kv_dtype))


def _logits(model, cache, ids) -> torch.Tensor:
    return model.logits(model.hidden(torch.tensor(ids), cache))


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.uint8, torch.bfloat16])
def test_the_step_is_its_python_chain_and_close_to_f16(tiny_q4_k_m, kv_dtype):
    """Native pass == decoder_step_reference bit for bit on a Q8_0 or bfloat16 cache (the K/V
    bytes written and the attention over them), and near the float32 cache's logits."""
    model = _model(tiny_q4_k_m, kv_dtype)
    native = _logits(model, model.new_cache(64), PROMPT)
    assert model.new_cache(8).k.dtype == kv_dtype
    model.whole.run = lambda *args: decoder_step.decoder_step_reference(model.layers, *args)
    assert torch.equal(native, _logits(model, model.new_cache(64), PROMPT))
    others = {}
    for dtype in (torch.float32, torch.float16):
        m = _model(tiny_q4_k_m, dtype)
        others[dtype] = _logits(m, m.new_cache(64), PROMPT)
    exact = others[torch.float32]
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    # This random model amplifies any rounding (float16 K/V alone move its logits ~5% rms
    # from float32 ones): Q8_0's and bfloat16's distances stay within twice float16's
    # (measured 1.57x and 1.47x).
    assert rms(native - exact) < 2 * rms(others[torch.float16] - exact)

@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.uint8, torch.bfloat16])
def test_a_sequence_swaps_out_and_back_bit_for_bit(tiny_q4_k_m, kv_dtype):
    cfg = tiny_q4_k_m[0]
    model = _model(tiny_q4_k_m, kv_dtype)
    cache = PagedKVCache(cfg, device_blocks=64, host_blocks=64, block_size=4, dtype=kv_dtype)
    assert cache.device_pool.k.shape[-1] == (cfg.head_dim // 32 * 34 if kv_dtype == torch.uint8
                                             else cfg.head_dim)
    kept, swapped = cache.allocate(), cache.allocate()
    for s in (kept, swapped):
        _logits(model, cache.view(s), PROMPT)
    cache.swap_out(swapped)
    assert cache.seqs[swapped].tier == "host" and cache.stats.bytes_out > 0
    assert torch.equal(_logits(model, cache.view(swapped), [60, 61]),  # swaps it back in
                       _logits(model, cache.view(kept), [60, 61]))


@needs_native
@pytest.mark.parametrize("kv_type,dtype,bytes_per_32", [("q8_0", torch.uint8, 34),
                                                        ("bf16", torch.bfloat16, 64)])
def test_an_engine_plans_its_kv_bytes_and_decodes(tiny_q4_k_m, kv_type, dtype, bytes_per_32):
    loaded = load_model(tiny_q4_k_m[2])
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, kv_type=kv_type))
    cfg, plan = loaded.config, engine.kv_plan
    assert engine.kv.device_pool.k.dtype == dtype == engine.kv.host_pool.v.dtype
    assert plan.block_bytes == 2 * plan.block_size * cfg.n_kv_heads * cfg.head_dim // 32 * bytes_per_32
    assert plan.block_bytes == engine.kv.device_pool.block_bytes
    done = engine.generate(PROMPT, sampling=GREEDY, max_tokens=6, ignore_eos=True)
    assert len(done.token_ids) == 6


@pytest.mark.parametrize("kv_type", ["q8_0", "bf16"])
def test_a_kv_type_with_the_float_reference_or_tier_attention_is_an_error(kv_type):
    with pytest.raises(ConfigError, match=f"--kv-type {kv_type}"):
        EngineOptions(kv_type=kv_type, weights="fp32")
    with pytest.raises(ConfigError, match=f"--kv-type {kv_type}"):
        EngineOptions(kv_type=kv_type, gpu_budget=1 << 30, tier_attention="bf16")
    with pytest.raises(ConfigError, match="--kv-type"):
        EngineOptions(kv_type="q4_0")


def test_info_counts_the_cache_in_its_type(capsys, tiny_q4_k_m):
    sizes = {}
    for kv_type in ("f16", "q8_0", "bf16"):
        assert cli.main(["info", "--model", str(tiny_q4_k_m[2]), "--ctx-size", "256",
                         "--kv-type", kv_type, "--json"]) == 0
        sizes[kv_type] = json.loads(capsys.readouterr().out)["memory"]["kv_cache_bytes"]
    assert sizes["q8_0"] * 64 == sizes["f16"] * 34 and sizes["bf16"] == sizes["f16"]


@needs_native
def test_the_kv_plan_is_sized_in_the_type_the_tier_pool_is_built_in():
    """Under a GPU budget, tier layers' K/V are built in the tier's float16 on CUDA (its torch
    attention reads no Q8_0) and in Q8_0 on a CPU tier (the C++ pass reads one pool for every
    layer): the plan, and so the tier's charge, takes each at that width. No CUDA is asked."""
    from ember.offload.runtime.engine_model import kv_value_bytes

    tier = EngineOptions(kv_type="q8_0", gpu_budget=1 << 30)
    assert kv_value_bytes(tier, torch.device("cuda")) == 2
    assert kv_value_bytes(tier, torch.device("cpu")) == 34 / 32
    assert kv_value_bytes(EngineOptions(kv_type="q8_0"), torch.device("cpu")) == 34 / 32
    host = EngineOptions(kv_type="q8_0", gpu_budget=1 << 30, tier_attention="host")
    assert kv_value_bytes(host, torch.device("cuda")) == 34 / 32  # attention stays on the host


@needs_native
@pytest.mark.parametrize("kv_type", ["q8_0", "bf16"])
def test_a_head_dim_the_type_cannot_take_is_a_clear_error(tiny_models, kv_type):
    """Both take 32 values at a time: a model with 16-value heads is refused when the engine
    is built, with the flag to change, not partway into a reply."""
    loaded = load_model(tiny_models["llama-silu_glu"][2])
    assert loaded.config.head_dim == 16
    with pytest.raises(ConfigError, match=f"--kv-type {kv_type} needs a head dim .* use --kv-type f16"):
        Engine(loaded, EngineOptions(device="cpu", n_ctx=64, kv_type=kv_type))
