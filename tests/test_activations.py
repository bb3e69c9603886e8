"""One activation table (models/activations.py) for the model, the references and the C++
kernels (csrc/activation.h): the codes name the same activations on both sides, and every
activation a model may carry round-trips through every kernel that takes one, against its
plain PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import cpu_extension, decoder_step, hot_ffn, sparse_ffn
from ember.models import activations
from ember.models.config import ACTIVATIONS, GATED_ACTIVATIONS, PLAIN_ACTIVATIONS
from ember.models.quantize import quantize
from ember.models.weights import QTensor

ALL = activations.NAMES


@pytest.fixture(scope="module")
def native():
    module = cpu_extension.load()
    if module is None:
        pytest.skip(f"C++ kernels unavailable: {cpu_extension.unavailable_reason()}")
    return module


def test_the_model_config_accepts_exactly_the_table():
    assert sorted(ACTIVATIONS) == sorted(ALL)
    assert set(GATED_ACTIVATIONS) == {a.name for a in activations.TABLE if a.gated}
    assert set(PLAIN_ACTIVATIONS) == {a.name for a in activations.TABLE if not a.gated}
    assert [a.code for a in activations.TABLE] == list(range(len(activations.TABLE)))


def test_unknown_names_get_an_error_that_lists_the_choices():
    with pytest.raises(ValueError, match="unknown activation 'swish'.*silu_glu"):
        activations.code("swish")


def test_cpp_codes_name_the_same_activations(native):
    for row in activations.TABLE:
        assert native.activation_name(row.code) == row.name
    for bad in (-1, len(activations.TABLE)):
        with pytest.raises(RuntimeError, match="unknown activation code"):
            native.activation_name(bad)


def _rows(g, n, k, scale=0.3):
    return torch.randn(n, k, generator=g) * scale


@pytest.mark.parametrize("act", ALL)
def test_sparse_ffn_kernel(act):
    g = torch.Generator().manual_seed(1)
    gate = _rows(g, 40, 32) if activations.is_gated(act) else None
    w = sparse_ffn.SparseFFNWeights.from_rows(gate, _rows(g, 40, 32), _rows(g, 40, 32), act)
    x, idx = torch.randn(3, 32, generator=g), torch.tensor([3, 0, 39, 17])
    torch.testing.assert_close(sparse_ffn.sparse_ffn(x, w, idx),
                               sparse_ffn.sparse_ffn_reference(x, w, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ALL)
def test_hot_ffn_kernel(act):
    g = torch.Generator().manual_seed(2)
    gate = _rows(g, 40, 32) if activations.is_gated(act) else None
    w = hot_ffn.HotFFNWeights.from_rows(gate, _rows(g, 40, 32), _rows(g, 40, 32), act)
    x = torch.randn(3, 32, generator=g)
    torch.testing.assert_close(hot_ffn.hot_ffn(x, w), hot_ffn.hot_ffn_reference(x, w),
                               rtol=1e-5, atol=1e-5)


def _q8(t: torch.Tensor) -> QTensor:
    return QTensor(quantize(t, int(Q.Q8_0)), int(Q.Q8_0), tuple(t.shape))


def _decoder_layer(g, act: str, hidden=64, heads=2, head_dim=32, ffn=64):
    gate_up = [_q8(_rows(g, ffn, hidden)) for _ in range(2 if activations.is_gated(act) else 1)]
    return decoder_step.DecoderLayer(
        attn_norm=torch.rand(hidden, generator=g) + 0.5,
        qkv=[_q8(_rows(g, heads * head_dim, hidden)) for _ in range(3)], n_heads=heads,
        n_kv=heads, head_dim=head_dim, q_norm=None, k_norm=None, interleaved=False,
        wo=_q8(_rows(g, hidden, heads * head_dim)), post_attn_norm=None,
        ffn_norm=torch.rand(hidden, generator=g) + 0.5, gate_up=gate_up,
        down=_q8(_rows(g, hidden, ffn)), activation=act, post_ffn_norm=None, eps=1e-6,
        scale=head_dim ** -0.5)


@pytest.mark.parametrize("act", ALL)
def test_decoder_step_kernel(native, act):
    g = torch.Generator().manual_seed(4)
    layers = [_decoder_layer(g, act)]
    x = torch.randn(2, 64, generator=g)
    slots = [[torch.tensor([0]), torch.tensor([0, 1])]]
    cos, sin = [torch.ones(2, 16)], [torch.zeros(2, 16)]
    results = []
    for run in (decoder_step.decoder_step(layers), decoder_step.decoder_step_reference):
        pools = torch.zeros(2, 4, 2, 32)
        args = (x, pools[0], pools[1], slots, torch.tensor([0, 1]), cos, sin)
        results.append(run(*args) if run is not decoder_step.decoder_step_reference
                       else run(layers, *args))
    assert torch.equal(*results)


def test_a_gated_activation_without_gate_weights_is_refused(native):
    g = torch.Generator().manual_seed(5)
    layer = _decoder_layer(g, "silu_glu")
    layer = layer._replace(gate_up=layer.gate_up[1:])
    with pytest.raises(RuntimeError, match="silu_glu takes gate and up weights"):
        decoder_step.decoder_step([layer])
