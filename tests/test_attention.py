"""kernels.attention: the tiled flash-attention kernel against a float64 reference, and a row's
bits alone, in a prompt chunk, in a tree, on 1 or 2 threads and on every CPU path, for
float32, float16, Q8_0 and bfloat16 pools (as the matmul kernels are tested)."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import attention
from ember.kernels import block_matmul as bm
from ember.kernels import cpu_extension
from ember.kernels.decoder_step import bf16_flushed
from ember.kernels.q8_matmul import q8_0_quantize

needs_kernels = pytest.mark.skipif(not attention.available(), reason="C++ kernels not built")
PATHS = bm.cpu_paths()


def _pools(n_slots: int, n_kv: int, hd: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_slots, n_kv, hd, generator=g) for _ in range(2))
    if kind == "f16":
        return k.half(), v.half()
    if kind == "q8_0":
        return (q8_0_quantize(x.reshape(-1, hd)).reshape(n_slots, n_kv, -1) for x in (k, v))
    if kind == "bf16":
        return bf16_flushed(k), bf16_flushed(v)
    return k, v


def _fits(kind: str, hd: int) -> bool:
    """Q8_0 blocks and bfloat16 dot products take 32 values at a time."""
    return kind in ("f32", "f16") or hd % 32 == 0


def _float64(q, k_pool, v_pool, slots, scale, softcap=0.0):
    """Each row's attention in float64 from the pools' values (and a bfloat16 pool's queries
    rounded to bfloat16, as its dot products take them)."""
    if k_pool.dtype == torch.bfloat16:
        q = q.bfloat16()
    out = []
    for t, s in enumerate(slots):
        keys = attention.pool_values(k_pool[s]).double()  # (S, n_kv, hd)
        values = attention.pool_values(v_pool[s]).double()
        n_heads, n_kv = q.shape[1], keys.shape[1]
        rows = []
        for h in range(n_heads):
            scores = keys[:, h * n_kv // n_heads] @ q[t, h].double() * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            rows.append(torch.softmax(scores, 0) @ values[:, h * n_kv // n_heads])
        out.append(torch.cat(rows))
    return torch.stack(out)


def _prompt(start: int, T: int, window: int | None, table: torch.Tensor):
    """Rows at positions start..start+T-1 reading `table` (pool row of each position)."""
    slots, positions = [], torch.arange(start, start + T)
    for p in range(start, start + T):
        lo = 0 if window is None else max(0, p - window + 1)
        slots.append(table[lo:p + 1])
    return slots, positions


@pytest.fixture
def path_and_threads():
    before, threads = bm.cpu_path(), torch.get_num_threads()
    yield
    bm.set_cpu_path(before)
    torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "bf16"])
@pytest.mark.parametrize("n_heads,n_kv,hd,window,softcap", [
    pytest.param(12, 2, 128, None, 0.0, marks=pytest.mark.slow), (4, 1, 256, 40, 0.0), (8, 8, 64, None, 30.0), (6, 3, 32, 17, 0.0)])
def test_every_path_matches_float64(path_and_threads, kind, n_heads, n_kv, hd, window, softcap):
    """A prompt chunk (causal, across several chunks and a window) on every CPU path, against
    float64 attention over the pool's own values. A bfloat16 pool's attention weights are
    rounded to bfloat16 (8 significant bits) before they weigh the values: within 2^-8 of
    the output's scale."""
    if not _fits(kind, hd):
        pytest.skip("needs whole 32-value groups")
    n_slots, start, T = 400, 130, 70
    k_pool, v_pool = _pools(n_slots, n_kv, hd, kind)
    table = torch.randperm(n_slots, generator=torch.Generator().manual_seed(1))
    slots, positions = _prompt(start, T, window, table)
    q = torch.randn(T, n_heads, hd, generator=torch.Generator().manual_seed(2)) * 2
    scale = hd ** -0.5
    want = _float64(q, k_pool, v_pool, slots, scale, softcap).reshape(T, -1)
    for path in PATHS:
        bm.set_cpu_path(path)
        got = attention.attend(q, k_pool, v_pool, slots, positions, scale, softcap)
        tol = 4e-3 if kind == "bf16" else 2e-5
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=path)


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "bf16"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_the_reference_matches_float64(kind, softcap):
    """attend_reference (what EMBER_KERNELS=reference runs) on the same prompt chunk."""
    k_pool, v_pool = _pools(200, 2, 64, kind)
    slots, positions = _prompt(90, 40, 33, torch.randperm(200))
    q = torch.randn(40, 6, 64) * 2
    want = _float64(q, k_pool, v_pool, slots, 0.125, softcap).reshape(40, -1)
    got = attention.attend_reference(q, k_pool, v_pool, slots, positions, 0.125, softcap)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "bf16"])
@pytest.mark.parametrize("n_heads,n_kv,hd,window", [(12, 2, 128, None), (4, 1, 256, 64),
                                                   (14, 2, 64, None), (3, 1, 48, None),
                                                   (16, 8, 64, None)])  # 8 KV heads: 4 per item
def test_a_row_has_the_same_bits_alone_in_a_chunk_in_a_tree_on_any_thread_count_and_path(
        path_and_threads, kind, n_heads, n_kv, hd, window):
    """Row at position p: decoded alone (one to three threads: the context split across them,
    the first part's thread running slow or not), as one row of a prompt chunk, and as a tree
    row reading the same keys from other pool rows beside rows whose keys differ; every CPU
    path gives the same bits too."""
    if not _fits(kind, hd):
        pytest.skip("needs whole 32-value groups")
    n_slots, start, T = 700, 300, 40
    k_pool, v_pool = _pools(n_slots, n_kv, hd, kind, seed=3)
    table = torch.randperm(n_slots - 50, generator=torch.Generator().manual_seed(4))
    slots, positions = _prompt(start, T, window, table)
    q = torch.randn(T, n_heads, hd, generator=torch.Generator().manual_seed(5))
    scale = hd ** -0.5
    results, kernels = [], cpu_extension.load()
    for path in PATHS:
        bm.set_cpu_path(path)
        for threads in (1, 2, 3):  # 3: a decoded row's context in uneven parts
            torch.set_num_threads(threads)
            chunk = attention.attend(q, k_pool, v_pool, slots, positions, scale)
            # the first part's thread running slow (0 or 1 chunks folded as it goes, the
            # rest taken by the others) or not
            for first_part_chunks in (-1, 0, 1):
                kernels.set_attention_first_part_chunks(first_part_chunks)
                try:
                    for t in (0, 17, T - 1):
                        alone = attention.attend(q[t:t + 1], k_pool, v_pool, slots[t:t + 1],
                                                 positions[t:t + 1], scale)
                        assert torch.equal(alone[0], chunk[t]), (path, threads, t, first_part_chunks)
                finally:
                    kernels.set_attention_first_part_chunks(-1)
            results.append(chunk)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    # A tree: the last row's keys, its last 5 (the "ancestors") moved to fresh pool rows,
    # beside two rows whose own keys there differ.
    t = T - 1
    moved = slots[t].clone()
    fresh = torch.arange(n_slots - 5, n_slots)
    moved[-5:] = fresh
    k_pool[fresh], v_pool[fresh] = k_pool[slots[t][-5:]], v_pool[slots[t][-5:]]
    other = slots[t].clone()
    other[-3:] = torch.arange(n_slots - 50, n_slots - 47)
    tree_slots = [other, moved, other[:-1]]
    tree_q = torch.stack([q[t], q[t], q[t - 1]])
    tree_pos = torch.tensor([positions[t], positions[t], positions[t] - 1])
    for path in PATHS:
        bm.set_cpu_path(path)
        tree = attention.attend(tree_q, k_pool, v_pool, tree_slots, tree_pos, scale)
        assert torch.equal(tree[1], results[0][t]), path


def _bf16_dots_or_skip(kernels):
    if "avx512" not in PATHS:
        pytest.skip("no AVX-512 path here")
    try:
        return kernels.set_attention_bf16_dots(True)
    except ValueError:
        pytest.skip("this CPU lacks AVX512_BF16")


@needs_kernels
@pytest.mark.parametrize("n_heads,n_kv,hd,window", [(12, 2, 128, None), (4, 1, 256, 17),
                                                   (16, 8, 64, None), (8, 8, 128, 33),
                                                   (3, 1, 96, 40), (2, 1, 512, None)])
def test_bf16_dot_products_give_the_float_paths_bits(path_and_threads, n_heads, n_kv, hd, window):
    """A decoded row over a bfloat16 pool, with AVX512_BF16's dot products (vdpbf16ps) and
    with the float fmas that write out their arithmetic: the same bits, at every position of
    a chunk (windows start a row's keys at odd positions) and on 1 or 2 threads (512-value
    heads: the scores past the dot path's 256 take the float path, its values the dots)."""
    kernels = cpu_extension.load()
    before = _bf16_dots_or_skip(kernels)
    try:
        bm.set_cpu_path("avx512")
        k_pool, v_pool = _pools(500, n_kv, hd, "bf16", seed=6)
        table = torch.randperm(500, generator=torch.Generator().manual_seed(7))
        slots, positions = _prompt(300, 70, window, table)
        q = torch.randn(70, n_heads, hd, generator=torch.Generator().manual_seed(8)) * 2
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for t in range(0, 70, 3):
                row = (q[t:t + 1], k_pool, v_pool, slots[t:t + 1], positions[t:t + 1], hd ** -0.5)
                kernels.set_attention_bf16_dots(True)
                native = attention.attend(*row)
                kernels.set_attention_bf16_dots(False)
                assert torch.equal(native, attention.attend(*row)), (threads, t)
    finally:
        kernels.set_attention_bf16_dots(before)


def test_bf16_pools_store_rounded_values_without_subnormals():
    """bf16_flushed: nearest-even rounding, subnormals as signed zeros (the dot products would
    read them as zeros). The kernels' store_row writes the same bytes: tests/test_kv_types.py
    runs a step against its Python chain."""
    x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1e-39, -1e-39, 3e38, -2.5])
    got = bf16_flushed(x)
    assert got.dtype == torch.bfloat16
    assert got.float().tolist()[:2] == [1.0, 1.0 + 2 ** -6]  # ties to even
    assert got.float().tolist()[2:4] == [0.0, 0.0]
    assert torch.signbit(got[3].float()) and not torch.signbit(got[2].float())
    assert got.float().tolist()[5] == -2.5


@needs_kernels
def test_softmax_is_exact_at_the_extremes():
    """Scores far below the max weigh nothing (exp underflow is 0, never garbage), a score
    far above the others takes all the weight, and equal scores weigh equally."""
    hd, n = 64, 140
    k_pool = torch.zeros(n, 1, hd)
    v_pool = torch.arange(n, dtype=torch.float32).repeat_interleave(hd).reshape(n, 1, hd)
    q = torch.zeros(1, 1, hd)
    q[0, 0, 0] = 1.0
    k_pool[:, 0, 0] = -1000.0
    k_pool[75, 0, 0] = 1000.0  # one key dominates: the output is its value row
    slots, pos = [torch.arange(n)], torch.tensor([n - 1])
    assert torch.equal(attention.attend(q, k_pool, v_pool, slots, pos, 1.0), torch.full((1, hd), 75.0))
    k_pool[:, 0, 0] = 0.0  # all equal: the mean of the values
    out = attention.attend(q, k_pool, v_pool, slots, pos, 1.0)
    torch.testing.assert_close(out, torch.full((1, hd), (n - 1) / 2), rtol=1e-6, atol=1e-6)


@needs_kernels
def test_bad_slots_and_positions_are_errors():
    pool = torch.randn(8, 1, 16)
    q = torch.randn(1, 2, 16)
    with pytest.raises(IndexError, match="slot"):
        attention.attend(q, pool, pool, [torch.tensor([3, 8])], torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        attention.attend(q, pool, pool, [torch.tensor([], dtype=torch.long)], torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="positions >= 0"):
        attention.attend(q, pool, pool, [torch.tensor([1, 2])], torch.tensor([0]), 1.0)
