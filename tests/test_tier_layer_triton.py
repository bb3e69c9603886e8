"""The GPU tier layer's small steps as Triton kernels (kernels/tier_layer_triton.py), on CUDA
where there is a device and else in Triton's interpreter on the CPU: each against its plain
reference (kernels/fused_ops.py) to float32 rounding, and a row's bits the same alone or
among others."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ember.kernels import tier_layer_triton as fused
from ember.kernels.fused_ops import (qk_norm_rope_reference, residual_norm_reference,
                                     rms_norm_reference)

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton comes with CUDA builds of PyTorch", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    if DEVICE.type == "cpu":  # Triton's interpreter (tests/conftest.py sets its mode)
        monkeypatch.setenv("EMBER_TIER_TRITON", "cpu")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [896, 1024])  # a hidden size not a power of two, and one that is
def test_rms_norm_and_the_residual_step_match_their_references(d):
    x, a = _randn(5, d, seed=1), _randn(5, d, seed=2)
    post, nxt = _randn(d, seed=3), _randn(d, seed=4)
    _close(fused.rms_norm(x.to(DEVICE), nxt.to(DEVICE), 1e-6), rms_norm_reference(x, nxt, 1e-6))
    for p, n in ((post, nxt), (None, nxt), (post, None), (None, None)):
        dev = [None if v is None else v.to(DEVICE) for v in (p, n)]
        got = fused.residual_norm(x.to(DEVICE), a.to(DEVICE), *dev, 1e-5)
        want = residual_norm_reference(x, a, p, n, 1e-5)
        _close(got[0], want[0])
        _close(got[1], want[1])
    # batch invariance: a row alone has the bits it has among the others
    both = fused.residual_norm(x.to(DEVICE), a.to(DEVICE), post.to(DEVICE), nxt.to(DEVICE), 1e-5)
    alone = fused.residual_norm(x[3:4].to(DEVICE), a[3:4].to(DEVICE), post.to(DEVICE),
                                nxt.to(DEVICE), 1e-5)
    assert torch.equal(alone[1], both[1][3:4]) and torch.equal(alone[0], both[0][3:4])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,norms", [(64, False), (128, True), (256, True)])
def test_qk_norm_rope_matches_its_reference(interleaved, head_dim, norms):
    n_heads, n_kv, t = 6, 2, 4
    qkv = _randn(t, (n_heads + 2 * n_kv) * head_dim, seed=5)
    angle = _randn(t, head_dim // 2, seed=6)
    cos, sin = angle.cos(), angle.sin()
    qn, kn = (_randn(head_dim, seed=7), _randn(head_dim, seed=8)) if norms else (None, None)
    want = qkv.clone()
    qk_norm_rope_reference(want, n_heads, n_kv, head_dim, qn, kn, cos, sin, interleaved, 1e-6)
    got = qkv.to(DEVICE)
    dev = [None if v is None else v.to(DEVICE) for v in (qn, kn)]
    fused.qk_norm_rope_(got, n_heads, n_kv, head_dim, *dev, cos.to(DEVICE), sin.to(DEVICE),
                        interleaved, 1e-6)
    _close(got, want)
    assert torch.equal(got.cpu()[:, -n_kv * head_dim:], qkv[:, -n_kv * head_dim:])  # v untouched
    row = qkv[2:3].to(DEVICE)
    fused.qk_norm_rope_(row, n_heads, n_kv, head_dim, *dev, cos[2:3].to(DEVICE),
                        sin[2:3].to(DEVICE), interleaved, 1e-6)
    assert torch.equal(row, got[2:3])


def test_qk_norm_rope_refuses_what_it_cannot_write_in_place():
    with pytest.raises(ValueError, match="contiguous float32"):
        fused.qk_norm_rope_(torch.zeros(2, 640, dtype=torch.float16), 4, 1, 64, None, None,
                            torch.ones(2, 32), torch.zeros(2, 32), False, 1e-6)



@pytest.mark.parametrize("pool_type,s", [(torch.float16, 70), (torch.bfloat16, 70),
                                          (torch.float16, 1000)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_attention_over_the_pool_matches_gathered_float32_attention(pool_type, s, softcap):
    """GQA (6 query heads a KV head, as the 1.5B), 70 listed keys in scattered pool rows (not
    a whole number of steps: 3 of the 16 stretches used) or 1000 (all 16), rows with their
    own masks; against softmax(q k^T) v in float64 from the same pool values; a row alone
    gives the bits it gives among the others."""
    n_heads, n_kv, hd, t = 12, 2, 128, 5
    k_pool = _randn(1200, n_kv, hd, seed=9).to(pool_type)
    v_pool = _randn(1200, n_kv, hd, seed=10).to(pool_type)
    keys = torch.randperm(1200, generator=torch.Generator().manual_seed(11))[:s]
    mask = torch.rand(t, s, generator=torch.Generator().manual_seed(12)) < 0.7
    mask[:, 0] = True  # every row sees a key
    q = _randn(t, n_heads, hd, seed=13)
    scale = hd ** -0.5
    got = fused.attend(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE), keys.to(DEVICE),
                       mask.to(DEVICE), scale, softcap).cpu()
    k = k_pool[keys].double().repeat_interleave(n_heads // n_kv, dim=1)  # (S, n_heads, hd)
    v = v_pool[keys].double().repeat_interleave(n_heads // n_kv, dim=1)
    scores = torch.einsum("thd,shd->ths", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    want = torch.einsum("ths,shd->thd", torch.softmax(scores, dim=-1), v).reshape(t, -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    alone = fused.attend(q[3:4].to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                         keys.to(DEVICE), mask[3:4].to(DEVICE), scale, softcap).cpu()
    assert torch.equal(alone, got[3:4])
    unmasked = fused.attend(q[:1].to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                            keys[mask[0]].to(DEVICE), None, scale, softcap).cpu()
    torch.testing.assert_close(unmasked, got[:1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lo,n", [(0, 1), (0, 70), (13, 33), (40, 60)])
def test_a_span_of_the_keys_counted_on_the_device_is_that_slice_bit_for_bit(lo, n):
    """What a CUDA graph replays: the keys' first index and count read by the kernel from a
    device tensor, over a table longer than them, give the bits of attending to the slice."""
    n_heads, n_kv, hd = 8, 2, 64
    k_pool = _randn(128, n_kv, hd, seed=21).half().to(DEVICE)
    v_pool = _randn(128, n_kv, hd, seed=22).half().to(DEVICE)
    table = torch.randperm(128, generator=torch.Generator().manual_seed(23))[:100].to(DEVICE)
    q = _randn(1, n_heads, hd, seed=24).to(DEVICE)
    span = torch.tensor([lo, n], device=DEVICE)
    got = fused.attend(q, k_pool, v_pool, table, None, 0.125, 0.0, span=span)
    want = fused.attend(q, k_pool, v_pool, table[lo:lo + n], None, 0.125, 0.0)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="without a mask"):
        fused.attend(q, k_pool, v_pool, table, torch.ones(1, 100, dtype=torch.bool,
                                                          device=DEVICE), 0.125, 0.0, span=span)


def test_attention_refuses_what_it_cannot_take():
    pool = torch.zeros(8, 2, 64, device=DEVICE)
    keys = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        fused.attend(torch.zeros(fused.ATTEND_ROWS + 1, 4, 64, device=DEVICE), pool, pool, keys,
                     None, 0.125, 0.0)
    with pytest.raises(ValueError, match="multiple of n_kv"):
        fused.attend(torch.zeros(1, 3, 64, device=DEVICE), pool, pool, keys, None, 0.125, 0.0)


@pytest.mark.parametrize("pool_type", [torch.float16, torch.bfloat16, torch.float32])
def test_stored_rows_are_torchs_conversion_bit_for_bit(pool_type):
    n_heads, n_kv, hd, t = 4, 2, 64, 3
    qkv = _randn(t, (n_heads + 2 * n_kv) * hd, seed=14) * 3
    own = torch.tensor([7, 2, 5])
    k_pool, v_pool = (torch.zeros(10, n_kv, hd, dtype=pool_type) for _ in "kv")
    k_dev, v_dev = k_pool.clone().to(DEVICE), v_pool.clone().to(DEVICE)  # not the same tensors
    fused.store_kv(qkv.to(DEVICE), n_heads, n_kv, hd, k_dev, v_dev, own.to(DEVICE))
    k = qkv[:, n_heads * hd:(n_heads + n_kv) * hd].reshape(t, n_kv, hd)
    v = qkv[:, (n_heads + n_kv) * hd:].reshape(t, n_kv, hd)
    k_pool.index_copy_(0, own, k.to(pool_type))
    v_pool.index_copy_(0, own, v.to(pool_type))
    assert torch.equal(k_dev.cpu(), k_pool) and torch.equal(v_dev.cpu(), v_pool)


def test_the_kernels_pass_their_own_check_and_a_wrong_one_is_caught(monkeypatch):
    from ember.kernels import tier_blocks_triton

    assert fused.self_check(DEVICE) and tier_blocks_triton.self_check(DEVICE)
    monkeypatch.setattr(fused, "rms_norm", lambda x, w, eps: x.float() * w)
    assert not fused.self_check(DEVICE)


def test_kernels_that_fail_their_check_leave_the_tier_to_torch_ops(monkeypatch, caplog):
    """A Triton or a GPU that cannot compile a kernel, or computes something else, costs
    speed, not a decode: the tier runs the references, and one warning says why."""
    from ember.kernels import tier_attention, triton_support

    monkeypatch.setattr(triton_support, "_checked", {})
    calls = []

    def broken(device):
        calls.append(device)
        raise RuntimeError("PTX assembly failed\nmore lines")

    monkeypatch.setattr(fused, "self_check", broken)
    with caplog.at_level("WARNING", logger="ember.kernels"):
        assert tier_attention.layer_ops(DEVICE) is tier_attention.REFERENCE_OPS
        assert tier_attention.layer_ops(DEVICE) is tier_attention.REFERENCE_OPS
    assert len(calls) == 1  # checked once per process and device
    (record,) = [r for r in caplog.records if "kernels are off" in r.getMessage()]
    assert "RuntimeError: PTX assembly failed" in record.getMessage()
    assert "more lines" not in record.getMessage()
    monkeypatch.setattr(triton_support, "_checked", {})
    monkeypatch.setattr(fused, "self_check", lambda device: False)
    assert tier_attention.layer_ops(DEVICE) is tier_attention.REFERENCE_OPS
    monkeypatch.setattr(triton_support, "_checked", {})
    monkeypatch.setattr(fused, "self_check", lambda device: True)
    assert tier_attention.layer_ops(DEVICE) is tier_attention.TRITON_OPS
