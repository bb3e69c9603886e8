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


# Four keys at a time plus a tail (s % 4), head dims the vector code takes (multiples of 8)
# and others, grouped query heads, one key, and contexts long enough for the exp's vector body.
@pytest.mark.parametrize("nh,nkv,hd,s", [(4, 1, 256, 1), (4, 2, 10, 37), (3, 3, 7, 5),
                                         (8, 1, 64, 61), (4, 4, 128, 6), (32, 4, 64, 64)])
def test_attend_slots_matches_gathered_attention(fast, nh, nkv, hd, s):
    g = torch.Generator().manual_seed(nh * 100 + s)
    k_pool, v_pool = torch.randn(64, nkv, hd, generator=g), torch.randn(64, nkv, hd, generator=g)
    slots = torch.randperm(64, generator=g)[:s]  # scattered rows, as paged blocks are
    q = torch.randn(nh, hd, generator=g) * 2
    got = fast.attend_slots(q, k_pool, v_pool, slots, 0.3)
    want = fused_ops.attend_slots_reference(q, k_pool, v_pool, slots, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attend_slots_softmax_is_exact_at_the_extremes(fast):
    """Scores far below the max weigh nothing (exp underflow is 0, never garbage), a score
    far above the others takes all the weight, and equal scores weigh equally."""
    hd, n = 64, 12
    k_pool = torch.zeros(n, 1, hd)
    v_pool = torch.arange(n, dtype=torch.float32).repeat_interleave(hd).reshape(n, 1, hd)
    q = torch.zeros(1, hd)
    q[0, 0] = 1.0
    k_pool[:, 0, 0] = -1000.0
    k_pool[5, 0, 0] = 1000.0  # one key dominates: the output is its value row
    slots = torch.arange(n)
    out = fast.attend_slots(q, k_pool, v_pool, slots, 1.0)
    assert torch.equal(out, torch.full((1, hd), 5.0))
    k_pool[:, 0, 0] = 0.0  # all equal: the mean of the values
    out = fast.attend_slots(q, k_pool, v_pool, slots, 1.0)
    torch.testing.assert_close(out, torch.full((1, hd), (n - 1) / 2), rtol=1e-6, atol=1e-6)


def test_attend_slots_gives_a_row_the_same_bits_in_any_company(fast):
    """A key's score is computed the same way in any lane of the 4-key step or in the tail:
    a row's result depends only on its own keys, so repeating the call on a pool where other
    rows changed gives the same bits, and the result is the same with the keys' rows moved
    elsewhere in the pool (paged blocks land anywhere)."""
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, s = 8, 2, 64, 23
    k_pool, v_pool = torch.randn(80, nkv, hd, generator=g), torch.randn(80, nkv, hd, generator=g)
    q = torch.randn(nh, hd, generator=g)
    slots = torch.arange(s)
    a = fast.attend_slots(q, k_pool, v_pool, slots, 0.125)
    moved = torch.arange(40, 40 + s)
    k_pool[moved], v_pool[moved] = k_pool[slots].clone(), v_pool[slots].clone()
    k_pool[:s] = torch.randn(s, nkv, hd, generator=g)  # the old rows now hold other keys
    b = fast.attend_slots(q, k_pool, v_pool, moved, 0.125)
    assert torch.equal(a, b)


def test_attend_slots_rejects_bad_slots(fast):
    pool = torch.randn(8, 1, 4)
    with pytest.raises(IndexError, match="slot"):
        fast.attend_slots(torch.randn(2, 4), pool, pool, torch.tensor([3, 8]), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        fast.attend_slots(torch.randn(2, 4), pool, pool, torch.tensor([], dtype=torch.long), 1.0)


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
