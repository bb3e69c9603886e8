"""The Q8_0 matmul kernel against its reference, and the quantized LM head in a model."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import q8_matmul
from ember.models import quants
from ember.models.quantize import quantize

needs_kernel = pytest.mark.skipif(not q8_matmul.available(),
                                  reason="C++ kernels not built on this machine")


def _rows(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    return q8_matmul.q8_0_rows(quantize(w, Q.Q8_0), n, k)


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (1000, 640), (333, 96)])
@pytest.mark.parametrize("t", [1, 3, 4, 5, 9])
def test_kernel_matches_reference(n, k, t):
    rows = _rows(n, k)
    x = torch.randn(t, k)
    ref = q8_matmul.q8_0_matmul_reference(x, rows)
    got = q8_matmul.q8_0_matmul(x, rows)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_each_row_of_x_is_independent_of_the_batch():
    """Scoring rows together or one by one gives bit-identical logits (speculation relies on it)."""
    rows, x = _rows(500, 640), torch.randn(6, 640)
    together = q8_matmul.q8_0_matmul(x, rows)
    alone = torch.cat([q8_matmul.q8_0_matmul(x[i:i + 1], rows) for i in range(6)])
    assert torch.equal(together, alone)


def test_reference_is_exact_dequantized_matmul():
    rows, x = _rows(50, 64), torch.randn(2, 64)
    w = quants.dequantize(rows.reshape(-1), Q.Q8_0, (50, 64))
    torch.testing.assert_close(q8_matmul.q8_0_matmul_reference(x, rows), x @ w.t())


@needs_kernel
def test_quantized_head_in_a_q8_model_keeps_greedy_tokens(tiny_models, tmp_path):
    from ember.models import synthetic
    from ember.models.loader import load_model
    from ember.offload.engine import Engine, EngineOptions
    from ember.offload.sampler import GREEDY

    cfg, weights, _, _ = tiny_models["gemma3"]
    path = synthetic.write_gguf(tmp_path / "q8.gguf", cfg, weights, qtype=Q.Q8_0)
    fast = Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, lm_head="q8_0"))
    ref = Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, lm_head="fp32"))
    assert (fast.lm_head, ref.lm_head) == ("q8_0", "fp32")
    ids = fast.encode("the cat is in the hat")
    a = fast.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
    b = ref.generate(ids, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
    assert a == b
