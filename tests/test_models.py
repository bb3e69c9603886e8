"""Tiny models: loader round trips, forward vs the naive reference, KV cache vs full forward."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ember.models.loader import load_model, open_model
from ember.models.transformer import Transformer
from ember.models.weights import WeightStore, QTensor

from .reference_impl import reference_logits
from .conftest import TINY_KINDS

IDS = [2, 40, 41, 300, 7, 99, 120, 5, 250, 64, 77, 310, 12, 13, 14, 200]  # > window of 8


def _full_logits(model: Transformer, ids) -> torch.Tensor:
    cache = model.new_cache(64)
    return model.logits(model.hidden(torch.tensor(ids), cache))


@pytest.mark.parametrize("name", list(TINY_KINDS))
def test_gguf_roundtrip_keeps_config_and_weights(tiny_models, name):
    cfg, weights, gguf_path, _ = tiny_models[name]
    src = open_model(gguf_path)
    # GGUF stores floats as float32: compare eps approximately, everything else exactly.
    assert math.isclose(src.config.rms_eps, cfg.rms_eps, rel_tol=1e-6)
    # llama.cpp's LLaMA files store q/k rows permuted for pairwise RoPE.
    assert src.config.rope_interleaved == (cfg.architecture == "llama")
    assert replace(src.config, rms_eps=cfg.rms_eps, rope_interleaved=False) == cfg
    for tensor_name, tensor in weights.items():
        loaded = src.weights.load(tensor_name)
        if cfg.architecture == "llama" and tensor_name.endswith(("attn_q.weight", "attn_k.weight")):
            continue  # stored permuted for llama.cpp's RoPE layout; checked through logits
        torch.testing.assert_close(loaded, tensor, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(TINY_KINDS))
def test_forward_matches_naive_reference(tiny_models, name):
    cfg, weights, gguf_path, _ = tiny_models[name]
    model = load_model(gguf_path).model
    expected = reference_logits(cfg, weights, IDS).float()
    torch.testing.assert_close(_full_logits(model, IDS), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(TINY_KINDS))
def test_safetensors_folder_gives_same_logits_as_gguf(tiny_models, name):
    _, _, gguf_path, hf_dir = tiny_models[name]
    a = _full_logits(load_model(gguf_path).model, IDS)
    b = _full_logits(load_model(hf_dir).model, IDS)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemma3", "llama-relu_glu"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_cached_decode_equals_full_forward(tiny_models, name, chunk):
    model = load_model(tiny_models[name][2]).model
    full = _full_logits(model, IDS)
    cache = model.new_cache(64)
    rows = []
    for lo in range(0, len(IDS), chunk):
        rows.append(model.logits(model.hidden(torch.tensor(IDS[lo:lo + chunk]), cache)))
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-5, atol=1e-5)


def test_truncate_then_recompute_matches(tiny_models):
    model = load_model(tiny_models["gemma3"][2]).model
    cache = model.new_cache(64)
    model.hidden(torch.tensor(IDS), cache)
    cache.truncate(5)
    tail = model.logits(model.hidden(torch.tensor(IDS[5:]), cache))
    torch.testing.assert_close(tail, _full_logits(model, IDS)[5:], rtol=1e-5, atol=1e-5)


def test_quantized_q8_model_runs_close_to_f32(tiny_models, tmp_path):
    from gguf import GGMLQuantizationType

    from ember.models.testing import synthetic

    cfg, weights, gguf_path, _ = tiny_models["gemma3"]
    q8 = synthetic.write_gguf(tmp_path / "q8.gguf", cfg, weights, qtype=GGMLQuantizationType.Q8_0)
    src = open_model(q8)
    assert src.weights.get("blk.0.ffn_up.weight").qtype_name == "Q8_0"
    # The quantized blocks stay available (not only a float copy) for later kernels.
    assert src.weights.get("blk.0.ffn_up.weight").nbytes < weights["blk.0.ffn_up.weight"].numel() * 4
    a = _full_logits(load_model(gguf_path).model, IDS)
    b = _full_logits(load_model(q8).model, IDS)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_dequantize_rows_reads_selected_rows(tiny_models):
    src = open_model(tiny_models["gemma3"][2])
    emb = src.weights.get("token_embd.weight")
    rows = torch.tensor([3, 0, 17])
    torch.testing.assert_close(emb.dequantize_rows(rows), emb.dequantize()[rows])


def test_weight_store_names_missing_tensor(tmp_path):
    from ember.models.support.errors import ModelFormatError

    store = WeightStore(tmp_path / "m.gguf", {"a": QTensor.from_torch(torch.zeros(2))})
    with pytest.raises(ModelFormatError, match="tensor 'b' is missing"):
        store.get("b")
    with pytest.raises(ModelFormatError, match="shape"):
        store.get("a", (3,))
