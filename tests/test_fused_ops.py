"""Fused decode-step ops (kernels/fused_ops.py) against their references."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_extension, fused_ops


@pytest.fixture(scope="module")
def fast():
    if cpu_extension.forced_reference() or not fused_ops.available():
        pytest.skip(f"C++ kernels not built here: {cpu_extension.unavailable_reason()}")
    return cpu_extension.load()


def close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("t,d", [(1, 640), (3, 7), (5, 33)])
def test_rms_norm_matches_reference(fast, t, d):
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(t, d, generator=g) * 3, torch.randn(d, generator=g)
    close(fast.rms_norm(x, w, 1e-6), fused_ops.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("nxt", [False, True])
def test_residual_norm_matches_reference(fast, post, nxt):
    g = torch.Generator().manual_seed(1)
    x, a = torch.randn(4, 37, generator=g), torch.randn(4, 37, generator=g)
    pw = torch.randn(37, generator=g) if post else None
    nw = torch.randn(37, generator=g) if nxt else None
    got = fast.residual_norm(x, a, pw, nw, 1e-6)
    want = fused_ops.residual_norm_reference(x, a, pw, nw, 1e-6)
    close(got[0], want[0])
    close(got[1], want[1])
    if not nxt:
        assert got[1] is got[0] or torch.equal(got[1], got[0])


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_norm_rope_matches_reference(fast, norms, interleaved):
    g = torch.Generator().manual_seed(2)
    t, nh, nkv, hd = 3, 4, 2, 10
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g)
    qn = torch.randn(hd, generator=g) if norms else None
    kn = torch.randn(hd, generator=g) if norms else None
    angles = torch.randn(t, hd // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    got, want = qkv.clone(), qkv.clone()
    fast.qk_norm_rope_(got, nh, nkv, hd, qn, kn, cos, sin, interleaved, 1e-6)
    fused_ops.qk_norm_rope_reference(want, nh, nkv, hd, qn, kn, cos, sin, interleaved, 1e-6)
    close(got, want)
    assert torch.equal(got[:, (nh + nkv) * hd:], qkv[:, (nh + nkv) * hd:])  # v untouched


def test_rows_are_batch_invariant(fast):
    g = torch.Generator().manual_seed(3)
    x, a, w = (torch.randn(6, 640, generator=g) for _ in range(3))
    together = fast.residual_norm(x, a, w[0], w[1], 1e-6)
    for i in range(6):
        alone = fast.residual_norm(x[i:i + 1], a[i:i + 1], w[0], w[1], 1e-6)
        assert torch.equal(alone[1][0], together[1][i])
    assert torch.equal(fast.rms_norm(x, w[2], 1e-6)[4], fast.rms_norm(x[4:5], w[2], 1e-6)[0])


def test_bad_shapes_are_clear_errors(fast):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        fast.rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        fast.rms_norm(x.t(), torch.randn(2), 1e-6)
    with pytest.raises(RuntimeError, match="columns"):
        fast.qk_norm_rope_(torch.randn(1, 30), 2, 1, 8, None, None, torch.ones(1, 4),
                           torch.zeros(1, 4), False, 1e-6)


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100, 262144])
def test_argmax_follows_torch(fast, n):
    g = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=g)
    assert fast.argmax(v) == int(torch.argmax(v))
    v[n // 3] = v[n - 1] = v.max() + 1  # a tie: the first one wins
    assert fast.argmax(v) == int(torch.argmax(v)) == n // 3
    assert fast.argmax(torch.zeros(n)) == 0
    assert fast.argmax(torch.full((n,), -float("inf"))) == 0
    v[n // 2] = float("inf")
    assert fast.argmax(v) == n // 2
    v[n - 1] = float("nan")  # NaN counts as the largest, as in torch
    assert fast.argmax(v) == int(torch.argmax(v)) == n - 1


def test_argmax_wrapper_takes_any_vector():
    v = torch.randn(50, dtype=torch.float64)
    assert fused_ops.argmax(v) == int(torch.argmax(v))
    assert fused_ops.argmax(v.float()[::2]) == int(torch.argmax(v.float()[::2]))


@pytest.mark.parametrize("n,k", [(1, 1), (7, 7), (8, 3), (100, 1), (1000, 40), (262144, 40)])
def test_top_k_follows_a_stable_descending_sort(fast, n, k):
    g = torch.Generator().manual_seed(n + k)
    v = torch.randn(n, generator=g)
    v[n // 2] = v[n - 1] = v.max()  # a tie at the top: the lower index first
    got, want = fast.top_k(v, k), fused_ops.top_k_reference(v, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    v[n // 3] = float("nan")  # counts as the largest, as in torch.sort
    got, want = fast.top_k(v, k), fused_ops.top_k_reference(v, k)
    assert torch.equal(got[1], want[1]) and int(got[1][0]) == n // 3
    with pytest.raises(RuntimeError, match="1 <= k"):
        fast.top_k(v, n + 1)


def test_top_k_above_the_native_limit_is_torch_topk():
    v = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    k = fused_ops.TOP_K_NATIVE_MAX + 1
    values, ids = fused_ops.top_k(v, k)
    want = torch.topk(v, k)
    assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
