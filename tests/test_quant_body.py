"""The quantized dense body (offload/body/quant_body.py): Q8_0 projections swapped into a model."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import q8_matmul
from ember.models.transformer import FeedForward, Projection
from ember.offload.body.quant_body import BlockFeedForward, BlockProjection, use_body

needs_kernel = pytest.mark.skipif(not q8_matmul.available(),
                                  reason="C++ kernels not built on this machine")


def _engine(path, weights):
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    return Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, weights=weights))


@needs_kernel
@pytest.mark.parametrize("name", ["gemma3", "llama-silu_glu", "llama-relu"])
def test_q8_body_keeps_first_tokens_and_logits_close(tiny_models, name):
    path = tiny_models[name][2]
    fast, ref = _engine(path, "q8"), _engine(path, "fp32")
    assert (fast.weights, ref.weights) == ("q8", "fp32")
    attn, ffn = fast.model.blocks[0].attn, fast.model.blocks[0].ffn
    assert isinstance(attn.wq, BlockProjection) and isinstance(ffn.fast, BlockFeedForward)
    assert isinstance(ref.model.blocks[0].attn.wq, Projection)
    ids = fast.encode("the cat is in the hat")
    a = fast.runner.prefill("s", ids)
    b = ref.runner.prefill("s", ids)
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # random tiny weights: the worst case
    from ember.offload.decode.sampler import GREEDY

    fast.runner.reset("s")
    ref.runner.reset("s")
    # Random tiny weights have near-ties a few steps in; the default model's greedy fixtures
    # (test_default_model.py, run on the q8 body) are the real check.
    got = fast.generate(ids, sampling=GREEDY, max_tokens=4, ignore_eos=True).token_ids
    want = ref.generate(ids, sampling=GREEDY, max_tokens=4, ignore_eos=True).token_ids
    assert got == want


@needs_kernel
def test_projection_rows_are_batch_invariant():
    torch.manual_seed(0)
    proj = BlockProjection(Projection(torch.randn(640, 1024) * 0.05))
    x = torch.randn(7, 640)
    together = proj(x)
    assert torch.equal(together, torch.cat([proj(x[i:i + 1]) for i in range(7)]))
    torch.testing.assert_close(together, x @ proj.source.weight, rtol=0.02, atol=0.05)


def test_use_body_switches_back_and_forth(tiny_models):
    from ember.models.loader import load_model

    model = load_model(tiny_models["gemma3"][2]).model
    source = model.blocks[1].attn.wo
    assert use_body(model, "q8") == "q8"
    assert model.blocks[1].attn.wo.source is source
    assert isinstance(model.blocks[1].ffn, FeedForward)  # its float tensors stay readable
    assert model.blocks[1].ffn.fast is not None
    assert use_body(model, "fp32") == "fp32"
    assert model.blocks[1].attn.wo is source and model.blocks[1].ffn.fast is None


def test_projections_without_whole_blocks_stay_float(tiny_models):
    from ember.models.loader import load_model

    model = load_model(tiny_models["gemma3"][2]).model
    odd = Projection(torch.randn(48, 64))  # 48 inputs: not whole Q8_0 blocks
    model.blocks[0].attn.wq = odd
    use_body(model, "q8")
    assert model.blocks[0].attn.wq is odd
    assert isinstance(model.blocks[0].attn.wk, BlockProjection)


def test_unknown_choice_is_a_config_error():
    from ember.models.errors import ConfigError
    from ember.offload.runtime.engine import EngineOptions

    with pytest.raises(ConfigError, match="--weights"):
        EngineOptions(weights="q4")


@needs_kernel
@pytest.mark.slow
def test_q8_body_perplexity_within_1_percent_of_fp32(default_model_path):
    """Requantizing the file's 4-6 bit blocks to Q8_0 is near-lossless on English text."""
    from pathlib import Path

    from ember.offload.profile.perplexity import perplexity

    text = (Path(__file__).parent / "data" / "english.txt").read_text()
    ppl = {}
    for weights in ("fp32", "q8"):
        engine = _engine(default_model_path, weights)
        ids = engine.tokenizer.encode(text, add_bos=False)
        ppl[weights] = perplexity(engine.model, ids, engine.tokenizer.bos_id, window=512).ppl
    assert abs(ppl["q8"] / ppl["fp32"] - 1) < 0.01, ppl


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_0"])
def test_q4_0_and_q5_0_weights_are_widened_exactly(tiny_models, tmp_path, qtype):
    """A file's Q4_0/Q5_0 body weights become Q8_0 rows holding exactly the file's values (no
    requantization), fused q/k/v and gate/up included."""
    from gguf import GGMLQuantizationType as Q

    from ember.models import quants, synthetic
    from ember.models.loader import load_model

    cfg, weights, _, _ = tiny_models["gemma3"]
    path = synthetic.write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=Q[qtype])
    model = load_model(path).model
    assert use_body(model, "q8") == "q8"
    block = model.blocks[0]
    attn, ffn = block.attn, block.ffn

    def values(rows, n_in):
        return quants.dequantize(rows.reshape(-1), Q.Q8_0, (rows.shape[0], n_in))

    assert attn.wq.source.stored.qtype == Q[qtype]
    qkv = torch.cat([attn.wq.source.weight, attn.wk.source.weight, attn.wv.source.weight], 1)
    assert torch.equal(values(attn.wqkv.rows, qkv.shape[0]), qkv.t())
    gate_up = torch.cat([ffn.gate, ffn.up], 1)
    assert torch.equal(values(ffn.fast.gate_up, gate_up.shape[0]), gate_up.t())
