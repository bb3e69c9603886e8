"""Attention and its KV pool on the GPU tier in a 16-bit type (issue 17, item 2), on the CPU
standing in for CUDA: the batched kernel against its row-by-row reference, a split engine's
greedy output against the unsplit model up to a near-tie (tiny Q4_K_M llama, default model),
the plan's charges against the tensors' bytes, swaps that round-trip bit for bit, speculation
through it, and what `ember info` plans for the 7B."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from ember.kernels.tier_attention import (AttendRows, TierAttentionWeights, attention_bytes,
                                          tier_attention, tier_attention_reference)
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model, open_model
from ember.offload.body import file_blocks_model
from ember.offload.options.sampling import SamplingParams
from ember.offload.hybrid.memory_plan import workspace_bytes
from ember.offload.hybrid.tier_dtypes import attention_dtype, attention_format
from ember.offload.kv.plan import plan_kv
from ember.offload.runtime.engine import Engine, EngineOptions

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
SEVEN_B = Path("/work/models-cache/llama2-7b-q4_k_m.gguf")
GREEDY = SamplingParams(temperature=0.0)
needs_kernels = pytest.mark.skipif(not file_blocks_model.applies(),
                                   reason="C++ kernels not built on this machine")


# -- the kernel -----------------------------------------------------------------------------

def _layer(dtype, *, bias=False, qk_norm=False, sandwich=False, softcap=0.0, seed=0,
           device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden, n_heads, n_kv, hd = 64, 4, 2, 16
    q_cols, kv_cols = n_heads * hd, n_kv * hd

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1 + rand(n, scale=0.1)

    norms = {"attn_norm": norm(hidden), "ffn_norm": norm(hidden),
             "qkv_bias": rand(q_cols + 2 * kv_cols) if bias else None,
             "post_attn_norm": norm(hidden) if sandwich else None,
             "post_ffn_norm": norm(hidden) if sandwich else None,
             "q_norm": norm(hd) if qk_norm else None, "k_norm": norm(hd) if qk_norm else None}
    w = TierAttentionWeights.pack(rand(q_cols + 2 * kv_cols, hidden), rand(hidden, q_cols),
                                  norms, n_heads, n_kv, hd, False, 1e-6, hd ** -0.5, softcap,
                                  device, dtype)
    return w, g


def _pools(w, n_slots, dtype, g):
    k = torch.randn(n_slots, w.n_kv, w.head_dim, generator=g).to(dtype)
    return k, torch.randn(n_slots, w.n_kv, w.head_dim, generator=g).to(dtype)


def _rotary(T, hd, start=0):
    angles = torch.arange(start, start + T, dtype=torch.float64)[:, None] * \
        10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    return angles.cos().float(), angles.sin().float()


def _rows_cases():
    """(name, rows, T, start): a prompt chunk, a windowed chunk, one decoded token, a tree."""
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5))  # scattered slots
    cases = []
    for name, lo, start, T, window in (("chunk", 0, 3, 6, None), ("window", 2, 6, 5, 3),
                                       ("decode", 0, 9, 1, None)):
        table = perm[lo:start + T]
        cases.append((name, AttendRows(table, table[start - lo:],
                                       AttendRows.causal_mask(lo, start, T, window)), T, start))
    positions = [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3, 4]),
                 torch.tensor([0, 1, 2, 3, 5]), torch.tensor([0, 1, 2, 3, 5, 6])]
    table = perm[:7]
    mask, own = AttendRows.listed_mask(positions, 7)
    cases.append(("tree", AttendRows(table, table.index_select(0, own), mask), 4, 4))
    return cases


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 4e-3)])
@pytest.mark.parametrize("features", [{}, {"bias": True, "qk_norm": True},
                                      {"sandwich": True, "softcap": 20.0}])
@pytest.mark.parametrize("case", _rows_cases(), ids=lambda c: c[0])
def test_batched_tier_attention_is_its_row_by_row_reference(dtype, tol, features, case):
    _name, rows, T, start = case
    w, g = _layer(dtype, **features)
    x = torch.randn(T, 64, generator=g)
    cos, sin = _rotary(T, w.head_dim, start)
    k_pool, v_pool = _pools(w, 40, dtype, g)
    k_ref, v_ref, k_before = k_pool.clone(), v_pool.clone(), k_pool.clone()
    got = tier_attention(w, x, k_pool, v_pool, rows, cos, sin)
    want = tier_attention_reference(w, x, k_ref, v_ref, rows, cos, sin)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
    # Both wrote the rows' K/V at their own slots in the pool's type, and nothing else.
    assert k_pool.dtype == dtype
    torch.testing.assert_close(k_pool.float(), k_ref.float(), rtol=tol, atol=tol)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows.own] = False
    assert torch.equal(k_pool[untouched], k_before[untouched])
    assert not torch.equal(k_pool[rows.own], k_before[rows.own])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton comes with CUDA builds of PyTorch")
@pytest.mark.parametrize("features", [{}, {"bias": True, "qk_norm": True},
                                      {"sandwich": True, "softcap": 20.0}])
@pytest.mark.parametrize("case", _rows_cases(), ids=lambda c: c[0])
def test_the_layer_on_triton_kernels_is_its_reference(features, case, monkeypatch):
    """What a CUDA tier runs (kernels/tier_layer_triton.py: norms, rotary, K/V store,
    attention), on CUDA where there is a device, else in Triton's interpreter: the same layer
    as the row-by-row reference."""
    from ember.kernels.tier_attention import TRITON_OPS, layer_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        monkeypatch.setenv("EMBER_TIER_TRITON", "cpu")  # in Triton's interpreter (conftest.py)
    assert layer_ops(device) is TRITON_OPS
    _name, rows, T, start = case
    w, g = _layer(torch.float32, device=device, **features)
    x = torch.randn(T, 64, generator=g)
    cos, sin = _rotary(T, w.head_dim, start)
    k_pool, v_pool = _pools(w, 40, torch.float32, g)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    on = AttendRows(rows.keys.to(device), rows.own.to(device),
                    None if rows.mask is None else rows.mask.to(device))
    k_dev, v_dev = k_pool.to(device), v_pool.to(device)
    got = tier_attention(w, x.to(device), k_dev, v_dev, on, cos.to(device), sin.to(device),
                         TRITON_OPS)
    want = tier_attention_reference(w, x, k_ref, v_ref, rows, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    torch.testing.assert_close(k_dev.cpu(), k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_tier_copy_states_its_bytes_and_its_error(dtype):
    w, _ = _layer(dtype, bias=True, qk_norm=True, sandwich=True)
    assert w.nbytes() == attention_bytes(64, 64, 32, 16, dtype, qkv_bias=True, qk_norm=True,
                                         sandwich=True)
    assert all(t.dtype == dtype for t in w.tensors())
    bound = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 0.0}[dtype]
    assert 0 <= w.error["qkv"] <= bound and 0 <= w.error["o"] <= bound
    if dtype != torch.float32:
        assert w.error["qkv"] > 0


def test_the_attention_format_follows_the_flag_and_the_device():
    cpu = torch.device("cpu")
    assert attention_format("auto", cpu) == "file"  # the file's blocks, where the plan puts it
    assert attention_format("host", cpu) is None
    assert [attention_format(c, cpu) for c in ("file", "int8", "bf16", "fp16", "fp32")] == \
        ["file", "int8", "bf16", "fp16", "fp32"]
    # K/V beside them: float16 unless attention is in a float type
    assert [attention_dtype(c, cpu) for c in ("auto", "file", "int8", "bf16", "fp32")] == \
        [torch.float16, torch.float16, torch.float16, torch.bfloat16, torch.float32]
    assert attention_dtype("host", cpu) is None
    with pytest.raises(ConfigError, match="--tier-attention"):
        attention_format("q8", cpu)
    with pytest.raises(ConfigError, match="--tier-attention"):
        EngineOptions(tier_attention="fp8")


# -- through the engine ---------------------------------------------------------------------

def _attention_budget(cfg, dtype=torch.bfloat16, extra=0, n_ctx=64, head=False):
    """Working space, attention and its KV (n_ctx tokens) on the tier (and with `head` the
    LM head in `dtype`), plus `extra` bytes for FFN rows."""
    hd = cfg.head_dim
    attention = cfg.n_layers * attention_bytes(cfg.hidden_size, cfg.n_heads * hd,
                                               cfg.n_kv_heads * hd, hd, dtype, cfg.qkv_bias,
                                               cfg.qk_norm, cfg.sandwich_norms)
    kv = plan_kv(cfg, n_ctx, value_bytes=dtype.itemsize)
    head_bytes = cfg.vocab_size * cfg.hidden_size * dtype.itemsize if head else 0
    return workspace_bytes(cfg) + attention + kv.device_blocks * kv.block_bytes + head_bytes + extra


def _charges_are_the_tensors(engine: Engine, dtype: torch.dtype) -> None:
    """The plan charged, for attention, the KV pool (K/V in `dtype`) and the LM head, the
    bytes their tensors take."""
    plan, hybrid = engine.hybrid.plan, engine.hybrid
    assert plan.attention_on_gpu and hybrid.attention is not None
    charges = plan.charges()
    assert charges["attention"] == sum(w.nbytes() for w in hybrid.attention)
    assert charges["attention"] == sum(t.numel() * t.element_size()
                                       for w in hybrid.attention for t in w.tensors())
    pool = engine.kv.device_pool
    assert charges["kv_pool"] == pool.k.nbytes + pool.v.nbytes
    assert pool.k.dtype == dtype
    if hybrid.attention[0].fmt in ("bf16", "fp16", "fp32"):
        assert all(w.dtype == dtype for w in hybrid.attention)
    head = engine.model.head.nbytes if plan.lm_head_on_gpu else 0
    assert charges["lm_head"] == head and charges["predictors"] == 0
    assert plan.gpu_bytes <= plan.budget


@needs_kernels
@pytest.mark.parametrize("tier", ["bf16", "fp16", "fp32"])
def test_a_split_with_attention_on_the_tier_decodes_as_the_unsplit_model(tiny_q4_k_m, tier):
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)),
                                  PROMPT, 8)
    dtype = attention_dtype(tier, torch.device("cpu"))
    # the LM head too, and one 256-neuron group of each layer's FFN (~384 kB)
    budget = _attention_budget(loaded.config, dtype, extra=400_000, head=True)
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget,
                                          tier_attention=tier))
    try:
        _charges_are_the_tensors(engine, dtype)
        report = engine.hybrid_report()
        assert 0 < report["hot_fraction"] < 1
        held = report["tier_attention_weights"]
        assert held["format"] == tier and held["bytes"] == report["charges"]["attention"]
        assert report["on_gpu_tier"]["lm_head"]
        bound = 0.0 if tier == "fp32" else 5e-3  # against the file's values
        assert held["error_qkv"]["max"] <= bound and held["error_o"]["max"] <= bound
        got, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got)
    finally:
        engine.close()


@needs_kernels
def test_attention_on_the_tier_shrinks_the_hot_rows_budget(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    budget = _attention_budget(loaded.config, extra=300_000)
    plans = {}
    for tier in ("host", "bf16"):
        engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget,
                                              tier_attention=tier))
        plans[tier] = engine.hybrid.plan
        engine.close()
    host, tier = plans["host"], plans["bf16"]
    assert not host.attention_on_gpu and tier.attention_on_gpu
    moved = tier.charges()["attention"] + tier.charges()["kv_pool"]
    assert tier.ffn_bytes <= budget - tier.workspace - moved < host.ffn_bytes
    assert tier.placement.total_hot_fraction() < host.placement.total_hot_fraction()


@needs_kernels
def test_a_named_attention_type_that_does_not_fit_is_an_error(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    small = workspace_bytes(loaded.config) + 10_000
    with pytest.raises(ConfigError, match="--tier-attention bf16 needs .* or use "
                                          "--tier-attention host"):
        Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=small,
                                     tier_attention="bf16"))
    # auto with room for everything: the whole model on the tier in the file's blocks, which
    # a CPU tier runs in the one C++ pass
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=1 << 30))
    try:
        plan = engine.hybrid.plan
        assert plan.attention_on_gpu and plan.lm_head_on_gpu
        assert plan.placement.total_hot_fraction() == 1.0
        assert engine.model.runs is None and engine.model.batch_invariant
        assert engine.hybrid_report()["tier_attention_weights"]["format"] == "file"
        _charges_are_the_tensors(engine, file_blocks_model.KV_DTYPE)
    finally:
        engine.close()


@needs_kernels
def test_the_default_model_with_attention_on_the_tier_decodes_as_unsplit(default_greedy_reference):
    loaded, ids, want, gaps = default_greedy_reference
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=256, threads=2,
                                          gpu_budget=_attention_budget(
                                              loaded.config, extra=8 << 20, n_ctx=256),
                                          tier_attention="bf16"))
    try:
        _charges_are_the_tensors(engine, torch.bfloat16)
        assert 0 < engine.hybrid_report()["hot_fraction"] < 1
        got, _ = greedy_with_gaps(engine, ids, 12)
        assert_agrees_until_near_tie(want, gaps, got)
    finally:
        engine.close()


@needs_kernels
@pytest.mark.parametrize("tier", ["bf16", "fp16"])
def test_swapped_tier_kv_blocks_come_back_bit_for_bit(tiny_q4_k_m, tier):
    """A conversation's K/V, written by the tier's attention, leaves the tier for the host
    pool when another one needs the room and comes back with the same bits; decoding then
    goes on exactly as on an engine that never swapped."""
    loaded = load_model(tiny_q4_k_m[2])
    opts = dict(device="cpu", n_ctx=64, gpu_budget=_attention_budget(loaded.config),
                tier_attention=tier)
    engine = Engine(loaded, EngineOptions(**opts))
    steady = Engine(loaded, EngineOptions(**opts))
    try:
        runner, kv = engine.runner, engine.kv
        first = greedy_with_gaps(engine, PROMPT, 4, session="a")[0]
        seq = runner.sessions["a"].seq_id
        view = kv.view(seq)
        before = [tuple(t.clone() for t in view.read(layer, 0, view.length))
                  for layer in range(loaded.config.n_layers)]
        kv.swap_out(seq)
        assert kv.seqs[seq].tier == "host" and kv.host_pool.k.dtype == before[0][0].dtype
        greedy_with_gaps(engine, list(reversed(PROMPT)), 4, session="b")  # uses the room
        kv.swap_in(seq)
        for layer, (k, v) in enumerate(before):
            got_k, got_v = view.read(layer, 0, view.length)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert kv.usage()["swaps_out"] >= 1 and kv.usage()["swaps_in"] >= 1
        # The swapped conversation goes on as if it had never left.
        again = engine.generate(PROMPT + first, sampling=GREEDY, max_tokens=4, ignore_eos=True,
                                session="a").token_ids
        want = steady.generate(PROMPT + first, sampling=GREEDY, max_tokens=4, ignore_eos=True,
                               session="a").token_ids
        assert again == want
    finally:
        engine.close()
        steady.close()


@needs_kernels
@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_speculation_through_tier_attention_is_lossless(tiny_q4_k_m, drafter):
    loaded = load_model(tiny_q4_k_m[2])
    opts = dict(device="cpu", n_ctx=64, tier_attention="bf16",
                gpu_budget=_attention_budget(loaded.config, extra=300_000))
    prompt = PROMPT + PROMPT[1:]  # repeats: the lookup drafter finds drafts
    plain = Engine(loaded, EngineOptions(**opts))
    spec = Engine(loaded, EngineOptions(speculate=drafter, **opts))
    try:
        want = plain.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        got = spec.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        assert got == want
        assert spec.speculation["verifications"] > 0
    finally:
        plain.close()
        spec.close()


# -- what `ember info` plans ----------------------------------------------------------------

def _info_plan(source, budget, tier_attention="bf16"):
    """The FFN-rows plan with attention in bf16 (`auto` now asks for the whole-model plan in
    the file's bytes: tests/test_layer_plan.py)."""
    from ember.app.commands.info import _gpu_plan

    args = argparse.Namespace(gpu_budget=budget, ctx_size=4096, split="auto", tier_dtype="auto",
                              tier_attention=tier_attention, device="cpu")
    return _gpu_plan(source.config, args, min(4096, source.config.context_length), source)


@pytest.mark.skipif(not SEVEN_B.is_file(), reason="no 7B-shaped file")
def test_info_charges_the_7b_attention_at_its_bf16_bytes():
    source = open_model(SEVEN_B)
    cfg = source.config
    per_layer = attention_bytes(cfg.hidden_size, cfg.n_heads * cfg.head_dim,
                                cfg.n_kv_heads * cfg.head_dim, cfg.head_dim, torch.bfloat16)
    kv = cfg.n_layers * 4096 * 2 * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, bf16
    # 4 GiB cannot hold 4 GiB of bf16 attention and its 2 GiB KV: the FFN rows get it all.
    small = _info_plan(source, "4GiB")
    assert not small.attention_on_gpu and small.to_dict()["tier_attention"] == {
        "dtype": "bf16", "attention_bytes": cfg.n_layers * per_layer, "kv_pool_bytes": kv}
    assert any("as bf16 on the tier: no room" in line for line in small.describe())
    # 8 GiB holds them, and the hot rows shrink to what is left.
    big = _info_plan(source, "8GiB")
    charges = big.charges()
    assert big.attention_on_gpu and charges["attention"] == cfg.n_layers * per_layer
    assert charges["kv_pool"] == kv and big.gpu_bytes <= 8 << 30
    assert charges["ffn_hot"] <= (8 << 30) - charges["workspace"] - charges["attention"] - kv
    host = _info_plan(source, "8GiB", "host")
    assert not host.attention_on_gpu and host.hot_parameters > big.hot_parameters


def test_auto_moves_attention_only_where_the_host_then_reads_less(tiny_q4_k_m):
    """`--tier-attention auto` weighs the two plans by the bytes the host reads per token."""
    from ember.offload.hybrid.host_reads import HostReads
    from ember.offload.hybrid.memory_plan import ComponentBytes, plan_memory

    cfg = tiny_q4_k_m[0]
    budget = _attention_budget(cfg, extra=300_000)

    def plan(reads):
        sizes = ComponentBytes.estimate(cfg, 65_536, attention_dtype=torch.bfloat16,
                                        extras_movable=False, host_reads=reads)
        return plan_memory(cfg, budget, sizes)

    rows_win = HostReads(attention=1_000, neuron=(5_000,) * cfg.n_layers)
    attention_wins = HostReads(attention=50_000_000, neuron=(5_000,) * cfg.n_layers)
    assert not plan(rows_win).attention_on_gpu and plan(attention_wins).attention_on_gpu
    assert plan(None).attention_on_gpu  # a named type: moved whenever it fits
    # From the file: its attention blocks and K/V at half the context, its FFN rows' bytes.
    source = open_model(tiny_q4_k_m[2])
    reads = HostReads.of_file(cfg, source.weights, 64)
    w = source.weights
    blocks = sum(w.get(f"blk.{i}.attn_{n}.weight").nbytes for i in range(cfg.n_layers)
                 for n in ("q", "k", "v", "output"))
    assert reads.attention == blocks + cfg.n_layers * 32 * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    down = w.get("blk.0.ffn_down.weight").nbytes
    assert reads.neuron[0] == (2 * w.get("blk.0.ffn_up.weight").nbytes + down) // cfg.ffn_size


def test_the_memory_check_counts_the_whole_budget_when_attention_shares_it(tiny_q4_k_m):
    """On a CPU tier the budget is host RAM: with attention named onto it, all of it may be
    used (copies, KV pool and hot rows), not just what the FFN rows could take."""
    from ember.offload.hybrid.memory_plan import cold_neuron_bytes, neuron_bytes
    from ember.offload.hybrid.setup import resolve_cold_dtype
    from ember.offload.runtime import resources

    source = open_model(tiny_q4_k_m[2])
    cfg, cpu, budget = source.config, torch.device("cpu"), 1 << 30
    neurons = cfg.n_layers * cfg.ffn_size
    cold = neurons * cold_neuron_bytes(cfg.hidden_size, cfg.gated, resolve_cold_dtype("int8"))

    def extra(tier):
        opts = EngineOptions(device="cpu", gpu_budget=budget, tier_attention=tier,
                             cold_dtype="int8")
        return resources.split_rows_bytes(source, opts, cpu)

    assert extra("host") == cold + neurons * neuron_bytes(cfg.hidden_size, cfg.gated) < budget
    assert extra("bf16") == cold + budget


def test_a_named_attention_type_that_would_be_ignored_is_refused():
    # without a budget there is no tier; with --weights fp32 there are no file blocks to move
    with pytest.raises(ConfigError, match="--gpu-budget"):
        EngineOptions(tier_attention="bf16")
    with pytest.raises(ConfigError, match="--weights fp32"):
        EngineOptions(tier_attention="fp16", gpu_budget=1 << 20, weights="fp32")
    EngineOptions(tier_attention="host", weights="fp32")  # auto and host apply anywhere
    EngineOptions(tier_attention="fp32", gpu_budget=1 << 20)
