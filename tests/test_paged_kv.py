"""The paged KV cache against the contiguous reference: attention, verbs, random operation
sequences (hypothesis), budgets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.models.reference_cache import ContiguousKVCache
from ember.models.loader import load_model
from ember.kernels.page_advice import HUGE_PAGE
from ember.offload.kv.blocks import BlockAllocator, KVPool, OutOfBlocks
from ember.offload.kv.paged import DROPPED, HOST, HostLayers, PagedKVCache

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(tiny_models["gemma3"][2]).model  # window 8, layer 5 global


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def _reference_last_logits(model, ids):
    cache = ContiguousKVCache(model.cfg, len(ids))
    return model.logits(model.hidden(torch.tensor(ids), cache))[-1]


def _append(model, view, ids):
    return model.logits(model.hidden(torch.tensor(ids), view))[-1]


@pytest.mark.parametrize("chunk", [1, 5, 40])
@pytest.mark.parametrize("margin", [0, 4, 64])
def test_paged_equals_contiguous_across_the_window(model, chunk, margin):
    ids = _ids(40)  # 5x the 8-token window, 10 blocks of 4
    cache = PagedKVCache(model.cfg, device_blocks=6 * 12, block_size=4, rollback_margin=margin)
    view = cache.view(cache.allocate())
    contiguous = ContiguousKVCache(model.cfg, 64)
    for lo in range(0, len(ids), chunk):
        part = torch.tensor(ids[lo:lo + chunk])
        torch.testing.assert_close(model.logits(model.hidden(part, view)),
                                   model.logits(model.hidden(part, contiguous)), **TOL)
    if margin == 0:  # local layers keep only the blocks their window still sees
        local_blocks = sum(b is not None for b in cache.seqs[0].tables[0])
        assert local_blocks <= 8 // 4 + 1


def test_fork_shares_blocks_and_copies_on_write(model):
    cache = PagedKVCache(model.cfg, device_blocks=200, block_size=4)
    a = cache.allocate()
    _append(model, cache.view(a), _ids(10))
    used = cache.device_pool.allocator.n_used
    b = cache.fork(a)
    assert cache.device_pool.allocator.n_used == used  # nothing copied yet
    la = _append(model, cache.view(a), [7])
    lb = _append(model, cache.view(b), [9])
    assert cache.stats.cow_copies > 0
    torch.testing.assert_close(la, _reference_last_logits(model, _ids(10) + [7]), **TOL)
    torch.testing.assert_close(lb, _reference_last_logits(model, _ids(10) + [9]), **TOL)


def test_swap_out_and_in_is_lossless_and_counted(model):
    cache = PagedKVCache(model.cfg, device_blocks=200, host_blocks=200, block_size=4)
    s = cache.allocate()
    _append(model, cache.view(s), _ids(23))
    cache.swap_out(s)
    assert cache.seqs[s].tier == HOST and cache.device_pool.allocator.n_used == 0
    cache.swap_in(s)
    logits = _append(model, cache.view(s), [11])
    torch.testing.assert_close(logits, _reference_last_logits(model, _ids(23) + [11]), **TOL)
    u = cache.usage()
    assert u["swaps_out"] == u["swaps_in"] == 1 and u["bytes_out"] == u["bytes_in"] > 0


def test_full_device_pool_evicts_least_recently_used_idle_sequence(model):
    per_seq = 6 * 3  # 6 layers x 3 blocks of 4 for 12 tokens (window releases none yet)
    cache = PagedKVCache(model.cfg, device_blocks=per_seq * 2, host_blocks=per_seq * 2,
                         block_size=4, rollback_margin=64)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    for s in (a, b, c):
        _append(model, cache.view(s), _ids(12, seed=s))
    assert cache.seqs[a].tier == HOST  # oldest idle one went to host RAM
    assert cache.device_pool.allocator.n_used <= per_seq * 2
    logits = _append(model, cache.view(a), [3])  # coming back swaps it in (evicting b)
    torch.testing.assert_close(logits, _reference_last_logits(model, _ids(12, seed=a) + [3]), **TOL)
    assert cache.seqs[b].tier == HOST


def test_both_pools_full_drops_oldest_idle_and_never_corrupts(model):
    per_seq = 6 * 3
    cache = PagedKVCache(model.cfg, device_blocks=per_seq + 6, host_blocks=per_seq, block_size=4)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    for s in (a, b, c):
        _append(model, cache.view(s), _ids(12, seed=s))
    assert cache.seqs[a].tier == DROPPED and cache.stats.dropped == 1
    with pytest.raises(ValueError, match="dropped"):
        cache.swap_in(a)
    logits = _append(model, cache.view(c), [5])  # the active one continues
    torch.testing.assert_close(logits, _reference_last_logits(model, _ids(12, seed=c) + [5]), **TOL)


def test_context_larger_than_budget_is_a_clear_error(model):
    cache = PagedKVCache(model.cfg, device_blocks=6, block_size=4)
    with pytest.raises(OutOfBlocks, match="--kv-budget"):
        _append(model, cache.view(cache.allocate()), _ids(12))


def test_truncate_past_released_window_blocks_is_refused(model):
    cache = PagedKVCache(model.cfg, device_blocks=400, block_size=4, rollback_margin=4)
    s = cache.allocate()
    _append(model, cache.view(s), _ids(60))
    assert cache.can_truncate(s, 58)
    assert not cache.can_truncate(s, 20)
    with pytest.raises(ValueError):
        cache.truncate(s, 20)


def test_truncate_keeps_the_slot_tables_of_layers_it_does_not_shorten(model):
    """Speculation truncates every step: tables it leaves as they were keep their cached
    slots; the ones it shortens are rebuilt, and decoding goes on correctly."""
    cache = PagedKVCache(model.cfg, device_blocks=400, block_size=4)
    s, ids = cache.allocate(), _ids(10)
    view, seq = cache.view(s), cache.seqs[s]
    _append(model, view, ids)
    layers = range(model.cfg.n_layers)

    view.reserve(2)  # positions 10, 11: inside the last block
    for layer in layers:
        view.slots_of(layer, 0, 12)
    cache.truncate(s, 10)
    assert all(layer in seq.slot_cache for layer in layers)

    view.reserve(3)  # up to position 12: one more block per layer
    for layer in layers:
        view.slots_of(layer, 0, 13)
    cache.truncate(s, 10)  # frees it again
    assert not seq.slot_cache
    torch.testing.assert_close(_append(model, view, [7]), _reference_last_logits(model, ids + [7]),
                               **TOL)


def test_a_big_host_pool_starts_on_a_huge_page_and_a_small_one_is_plain():
    big = KVPool(512, 16, 2, 128, dtype=torch.float16)  # K and V 4 MiB each: huge pages
    for t in (big.k, big.v):
        assert t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous()
        assert t.shape == (512, 16, 2, 128) and t.dtype == torch.float16
    assert big.rows[0].data_ptr() == big.k.data_ptr() and big.block_bytes == 2 * 16 * 2 * 128 * 2
    small = KVPool(4, 16, 2, 128)
    assert small.k.shape == (4, 16, 2, 128) and small.k.dtype == torch.float32


def test_allocator_reference_counts():
    a = BlockAllocator(2)
    x = a.alloc()
    a.incref(x)
    a.decref(x)
    assert a.n_free == 1
    a.decref(x)
    assert a.n_free == 2
    a.alloc(), a.alloc()
    with pytest.raises(OutOfBlocks):
        a.alloc()


# -- random operation sequences against the contiguous reference ----------------------
OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 7)),
    st.tuples(st.just("fork"), st.integers(0, 9)),
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    st.tuples(st.just("swap_out"), st.integers(0, 9)),
    st.tuples(st.just("swap_in"), st.integers(0, 9)),
    st.tuples(st.just("switch"), st.integers(0, 9)),
)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=14), margin=st.sampled_from([0, 8, 64]),
       split=st.booleans())
def test_random_operation_sequences_match_reference(model, ops, margin, split):
    """The same with one pool, or split by layer (layers 1 and 5 in host RAM: a windowed and
    the global one), whose host layers' pool drops a sequence when full."""
    if split:
        cache = PagedKVCache(model.cfg, device_blocks=4 * 14, host_blocks=4 * 10, block_size=4,
                             rollback_margin=margin,
                             host_layers=HostLayers((1, 5), 2 * 14, torch.float32))
    else:
        cache = PagedKVCache(model.cfg, device_blocks=6 * 14, host_blocks=6 * 10, block_size=4,
                             rollback_margin=margin)
    tokens = {cache.allocate(): [2]}
    active = next(iter(tokens))
    _append(model, cache.view(active), [2])
    counter = 10
    for op, arg in ops:
        seq_ids = sorted(tokens)
        pick = seq_ids[arg % len(seq_ids)] if isinstance(arg, int) else active
        if cache.seqs[active].tier == DROPPED:  # recompute, as the engine would
            cache.free(active)
            active = cache.allocate()
            tokens[active] = tokens.pop(pick if pick == active else active, [2])
            _append(model, cache.view(active), tokens[active])
        if op == "append" and len(tokens[active]) + arg < 100:
            new = list(range(counter, counter + arg))
            counter += arg
            got = _append(model, cache.view(active), new)
            tokens[active] += new
            torch.testing.assert_close(got, _reference_last_logits(model, tokens[active]), **TOL)
        elif op == "fork" and cache.seqs[pick].tier != DROPPED:
            child = cache.fork(pick)
            tokens[child] = list(tokens[pick])
        elif op == "truncate":
            n = max(1, int(len(tokens[active]) * arg))
            if cache.can_truncate(active, n):
                cache.truncate(active, n)
                tokens[active] = tokens[active][:n]
        elif op == "swap_out" and pick != active:
            cache.swap_out(pick)
        elif op == "swap_in" and cache.seqs[pick].tier == HOST:
            cache.swap_in(pick)
        elif op == "switch" and cache.seqs[pick].tier != DROPPED:
            active = pick
        assert cache.device_pool.allocator.n_used <= cache.device_pool.n_blocks
    # Every surviving sequence still continues exactly as a full recompute would.
    for sid, ids in tokens.items():
        if sid in cache.seqs and cache.seqs[sid].tier != DROPPED:
            got = _append(model, cache.view(sid), [4])
            torch.testing.assert_close(got, _reference_last_logits(model, ids + [4]), **TOL)


def test_planned_blocks_suffice_for_a_full_context_prefilled_in_chunks(model):
    from ember.offload.kv.plan import blocks_for_one_sequence
    from ember.offload.decode.runner import Runner

    n_ctx, bs, margin, chunk = 200, 4, 4, 16
    need = blocks_for_one_sequence(model.cfg, n_ctx, bs, margin=margin, chunk=chunk)
    full = model.cfg.n_layers * (n_ctx // bs)
    assert need < full  # the five windowed layers keep only their window's blocks
    cache = PagedKVCache(model.cfg, device_blocks=need, block_size=bs, rollback_margin=margin)
    runner = Runner(model, cache, n_ctx, prefill_chunk=chunk)
    ids = _ids(n_ctx - 3)
    logits = runner.prefill("s", ids)
    torch.testing.assert_close(logits, _reference_last_logits(model, ids), **TOL)
    for t in (7, 8):
        runner.decode("s", t)
    assert cache.device_pool.allocator.n_used <= need


def test_swap_in_never_drops_the_sequence_being_swapped_in(model):
    """Device full of B, host full of A: bringing A back must evict B (dropping it if the host
    has no room), never drop A halfway through its own swap-in."""
    per_seq = 6 * 3
    cache = PagedKVCache(model.cfg, device_blocks=per_seq + 6, host_blocks=per_seq, block_size=4)
    a, b = cache.allocate(), cache.allocate()
    _append(model, cache.view(a), _ids(12, seed=1))
    _append(model, cache.view(b), _ids(12, seed=2))  # evicts a to the host
    assert cache.seqs[a].tier == HOST
    logits = _append(model, cache.view(a), [3])
    torch.testing.assert_close(logits, _reference_last_logits(model, _ids(12, seed=1) + [3]), **TOL)
    assert cache.seqs[b].tier == DROPPED


# -- a pool split by layer: host layers' blocks in their own pool, never swapped ------------
def _split_cache(model, host_layer_blocks=200):
    return PagedKVCache(model.cfg, device_blocks=200, host_blocks=200, block_size=4,
                        host_layers=HostLayers((1, 5), host_layer_blocks, torch.float32))


def test_a_split_pool_keeps_each_layer_in_its_pool_through_fork_and_swap(model):
    cache = _split_cache(model)
    device, apart = cache.device_pool, cache.host_layer_pool
    assert [cache.resident[i] is apart for i in range(6)] == [False, True, False, False,
                                                              False, True]
    s = cache.allocate()
    _append(model, cache.view(s), _ids(10))
    assert device.allocator.n_used == 4 * 3 and apart.allocator.n_used == 2 * 3
    b = cache.fork(s)  # shares every block in both pools
    assert device.allocator.n_used == 4 * 3 and apart.allocator.n_used == 2 * 3
    lb = _append(model, cache.view(b), [9])  # the shared last block: copied in both pools
    assert apart.allocator.n_used == 2 * 4 and device.allocator.n_used == 4 * 4
    assert cache.stats.cow_copies == 6
    torch.testing.assert_close(lb, _reference_last_logits(model, _ids(10) + [9]), **TOL)

    kept = [list(cache.seqs[s].tables[i]) for i in (1, 5)]
    cache.swap_out(s)  # only the device layers' blocks move; b still holds its own
    assert cache.seqs[s].tier == HOST
    assert cache.host_pool.allocator.n_used == 4 * 3
    assert apart.allocator.n_used == 2 * 4
    assert [cache.seqs[s].tables[i] for i in (1, 5)] == kept
    assert cache.stats.bytes_out == 4 * 3 * device.block_bytes
    cache.swap_in(s)
    la = _append(model, cache.view(s), [7])
    torch.testing.assert_close(la, _reference_last_logits(model, _ids(10) + [7]), **TOL)
    cache.free(b)
    cache.free(s)
    assert device.allocator.n_used == apart.allocator.n_used == cache.host_pool.allocator.n_used == 0
    assert cache.usage()["host_layer_blocks_free"] == 200


def test_a_full_host_layer_pool_drops_the_oldest_idle_sequence(model):
    cache = _split_cache(model, host_layer_blocks=2 * 3 + 2)  # one 12-token sequence
    a, b = cache.allocate(), cache.allocate()
    _append(model, cache.view(a), _ids(12, seed=1))
    logits = _append(model, cache.view(b), _ids(12, seed=2))
    assert cache.seqs[a].tier == DROPPED and cache.stats.dropped == 1
    torch.testing.assert_close(logits, _reference_last_logits(model, _ids(12, seed=2)), **TOL)


def test_the_plan_shares_its_blocks_out_by_layer(model):
    """What each layer holds of one sequence (here the whole context: the windows, the
    rollback margin and a prefill chunk cover it), and a budget's extra blocks shared in
    proportion, in whole blocks summing to the pool."""
    from ember.offload.kv.plan import plan_kv, share_blocks

    plan = plan_kv(model.cfg, 200, block_size=4)
    assert sum(plan.layer_blocks) == plan.device_blocks
    assert plan.layer_blocks == (50,) * 6
    assert plan.layer_bytes()[5] == 50 * plan.block_bytes
    bigger = plan_kv(model.cfg, 200, device_budget=3 * plan.device_blocks * plan.block_bytes + 5,
                     block_size=4)
    assert bigger.layer_blocks == tuple(3 * n for n in plan.layer_blocks)
    assert share_blocks([1, 1, 1], 4) == (2, 1, 1) and share_blocks([3, 1], 4) == (3, 1)
