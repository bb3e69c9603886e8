"""The CPU sparse FFN kernel against its PyTorch reference (fp32 and int8, every activation).

The fast-path tests need the C++ extension; it is built once (~30-60 s, cached under
TORCH_EXTENSIONS_DIR or ~/.cache/ember/torch_extensions). Where it cannot be built they skip
with the reason; the reference fallback is tested either way.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from ember.kernels import cpu_extension
from ember.kernels import sparse_ffn as sparse_ffn_module
from ember.kernels.ffn_bundles import dequantize_rows_int8, empty_bundles, quantize_rows_int8
from ember.kernels.sparse_ffn import (SparseFFNWeights, sparse_ffn, sparse_ffn_reference,
                                     sparse_ffn_thresholded, sparse_ffn_thresholded_reference)
from ember.models.activations import NAMES, activate, is_gated

ACTS = NAMES
SIZES = ((7, 1), (33, 13), (640, 2048))  # (hidden, ffn): odd tails, a single neuron, real shape


@pytest.fixture(scope="module")
def fast():
    if cpu_extension.forced_reference():
        pytest.skip("EMBER_KERNELS=reference forces the PyTorch fallback")
    if cpu_extension.load() is None:
        pytest.skip(f"C++ kernels could not be built here: {cpu_extension.unavailable_reason()}")
    return True


def make(act: str, hidden: int, ffn: int, dtype: str = "fp32", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = lambda: torch.randn(ffn, hidden, generator=g) / hidden ** 0.5  # noqa: E731
    gate = rows() if is_gated(act) else None
    up, down_nm = rows(), torch.randn(ffn, hidden, generator=g) / ffn ** 0.5
    return SparseFFNWeights.from_rows(gate, up, down_nm, act, dtype), torch.Generator().manual_seed(seed + 1)


reference = sparse_ffn_reference


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * (1 + b.abs().max().item()))


def index_sets(ffn: int, g: torch.Generator):
    perm = torch.randperm(ffn, generator=g)
    half = perm[: max(1, ffn // 2)]
    return {"unsorted": half, "sorted": half.sort().values, "all": torch.arange(ffn),
            "empty": torch.empty(0, dtype=torch.long)}


@pytest.mark.parametrize("dtype", ("fp32", "int8"))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("hidden,ffn", SIZES)
def test_fast_matches_reference(fast, act, dtype, hidden, ffn):
    w, g = make(act, hidden, ffn, dtype)
    for T in (1, 3):
        x = torch.randn(T, hidden, generator=g)
        for name, idx in index_sets(ffn, g).items():
            out = sparse_ffn(x, w, idx)
            assert out.shape == (T, hidden) and out.dtype == torch.float32
            if name == "empty":
                assert torch.equal(out, torch.zeros(T, hidden)), "empty active set must give zeros"
            else:
                close(out, reference(x, w, idx))


@pytest.mark.parametrize("dtype", ("fp32", "int8"))
@pytest.mark.parametrize("act", ("relu_glu", "gelu_glu", "relu"))
def test_all_active_equals_dense(fast, act, dtype):
    w, g = make(act, 640, 2048, dtype, seed=3)
    x = torch.randn(3, 640, generator=g)
    dense = sparse_ffn_reference(x, w)
    close(sparse_ffn(x, w), dense)
    close(sparse_ffn(x, w, torch.arange(2048)), dense)
    # Shuffled order: same sum, different rounding only.
    close(sparse_ffn(x, w, torch.randperm(2048, generator=g)), dense)


def test_many_tokens_and_vector_input(fast):
    # T = 5 crosses the kernel's 4-token register block, T = 20 its 16-token stack buffer;
    # a 1-D x gives a 1-D result.
    w, g = make("silu_glu", 33, 13, seed=5)
    idx = torch.tensor([12, 0, 7, 3], dtype=torch.int32)
    for T in (5, 20):
        x = torch.randn(T, 33, generator=g)
        close(sparse_ffn(x, w, idx), reference(x, w, idx.long()))
    close(sparse_ffn(x[0], w, idx), reference(x[:1], w, idx.long())[0])


def _thresholds(x, w, idx):
    """Thresholds on |h| for `x`: none dropped (0), about half (midway between two sorted
    |h| values, so float rounding cannot move a neuron across), and all (past the max)."""
    gate, up, _ = w.float_rows(idx)
    h = activate(w.activation, None if gate is None else x @ gate.t(), x @ up.t()).abs()
    values = h.flatten().sort().values
    everything = [0.0, float(values[-1]) * 2 + 1]
    if values.numel() < 2:
        return everything
    mid = values.numel() // 2 - 1
    return everything + [float(values[mid] + values[mid + 1]) / 2]


@pytest.mark.parametrize("dtype", ("fp32", "int8"))
@pytest.mark.parametrize("act", ("silu_glu", "gelu_glu", "relu"))
@pytest.mark.parametrize("hidden,ffn", SIZES)
def test_thresholded_matches_reference(fast, act, dtype, hidden, ffn):
    """The down matmul's input thresholded (issue 18): per token, neurons with |h| <= t
    add nothing, and `kept` counts the rest exactly."""
    w, g = make(act, hidden, ffn, dtype)
    for T in (1, 3, 5):
        x = torch.randn(T, hidden, generator=g)
        for idx in (None, index_sets(ffn, g)["unsorted"]):
            if ffn == 1 and idx is not None:
                continue
            for thr in _thresholds(x, w, idx):
                out, kept = sparse_ffn_thresholded(x, w, thr, idx)
                want, want_kept = sparse_ffn_thresholded_reference(x, w, thr, idx)
                close(out, want)
                assert torch.equal(kept, want_kept), (thr, kept, want_kept)


def test_thresholded_extremes(fast):
    w, g = make("silu_glu", 64, 96, "int8", seed=9)
    x = torch.randn(1, 64, generator=g)
    out, kept = sparse_ffn_thresholded(x, w, 0.0)
    close(out, sparse_ffn(x, w))
    assert kept.tolist() == [96]
    out, kept = sparse_ffn_thresholded(x, w, 1e9)
    assert torch.equal(out, torch.zeros(1, 64)) and kept.tolist() == [0]
    with pytest.raises(ValueError, match="h_threshold"):
        sparse_ffn_thresholded(x, w, -1.0)


def test_thread_counts_agree(fast):
    w, g = make("relu_glu", 640, 2048, "int8", seed=6)
    x = torch.randn(1, 640, generator=g)
    idx = torch.randperm(2048, generator=g)[:700]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sparse_ffn(x, w, idx)
        torch.set_num_threads(2)
        two = sparse_ffn(x, w, idx)
    finally:
        torch.set_num_threads(before)
    close(two, one)


def test_repeated_calls_give_the_same_bits(fast):
    # Threads take fixed shares and their sums are added in a fixed order: no run-to-run
    # noise in the low bits (speculation and the hybrid engine compare runs exactly).
    w, g = make("gelu_glu", 640, 2048, "int8", seed=11)
    x = torch.randn(3, 640, generator=g)
    idx = torch.randperm(2048, generator=g)[:1500].sort().values
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = sparse_ffn(x, w, idx)
        assert all(torch.equal(first, sparse_ffn(x, w, idx)) for _ in range(30))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_regions_use_torch_threads(fast, threads):
    # A build without OpenMP runs ATen's parallel_for serially, silently: the kernels were
    # single-threaded for weeks before this test existed.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert cpu_extension.load().parallel_workers() == threads
    finally:
        torch.set_num_threads(before)


def test_concurrent_callers(fast):
    # The hybrid engine calls the kernel from a worker thread (GIL released) while other
    # torch work runs: concurrent calls must not share scratch state.
    w, g = make("drelu", 640, 2048, seed=7)
    xs = [torch.randn(1, 640, generator=g) for _ in range(4)]
    idx = torch.randperm(2048, generator=g)[:1000]
    want = [reference(x, w, idx) for x in xs]
    got = [None] * 4

    def work(i):
        for _ in range(20):
            got[i] = sparse_ffn(xs[i], w, idx)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(got, want):
        close(a, b)


def _int8_error_bound(x, w32: SparseFFNWeights, w8: SparseFFNWeights, idx):
    """Worst-case |int8 - fp32| per output (T, hidden) from the quantization steps.

    Each weight is off by at most scale/2, so a dot with x is off by e = scale/2 * ||x||_1;
    the activations are Lipschitz (slope <= 1.13) and h'd' - hd = (h' - h) d + h' (d' - d).
    """
    sel = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
    l1 = x.abs().sum(1, keepdim=True)  # (T, 1)
    u = x @ sel(w32.up).t()  # (T, n)
    eu = l1 * sel(w8.up_scale)[None] / 2
    act = w32.activation
    lip = 1.13  # max slope of gelu-tanh (silu's is 1.10, relu's 1)
    if act == "relu":
        eh = eu
    elif act == "relu2":
        eh = (2 * u.abs() + eu) * eu
    else:
        gt = x @ sel(w32.gate).t()
        eg = l1 * sel(w8.gate_scale)[None] / 2
        f_abs = gt.abs() * lip  # |f(g)| <= lip * |g| for all four gate functions
        eh = lip * eg * (u.abs() + eu) + (f_abs + lip * eg) * eu
    h_abs = activate(act, None if w32.gate is None else x @ sel(w32.gate).t(), u).abs()
    d = sel(w32.down_nm).abs()  # (n, hidden)
    ed = sel(w8.down_scale)[:, None] / 2
    return eh @ d + (h_abs + eh) @ ed.expand_as(d)


@pytest.mark.parametrize("act", ACTS)
def test_int8_close_to_fp32_within_quantization_bound(act):
    w32, g = make(act, 640, 2048, seed=11)
    w8 = SparseFFNWeights.from_rows(w32.gate, w32.up, w32.down_nm, act, "int8")
    x = torch.randn(3, 640, generator=g)
    idx = torch.randperm(2048, generator=g)[:1024]
    bound = _int8_error_bound(x, w32, w8, idx)
    exact = reference(x, w32, idx)
    for op in (sparse_ffn_reference, sparse_ffn):
        err = (op(x, w8, idx) - exact).abs()
        assert bool((err <= bound * 1.01 + 1e-4).all()), f"{op.__name__}: max excess {(err - bound).max()}"
        assert err.max() > 0  # int8 really was used


def test_quantize_rows_int8_round_trip():
    w = torch.randn(9, 70)
    w[4] = 0.0  # an all-zero row stays exactly zero
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (9,)
    assert int(q.abs().max()) <= 127
    err = (dequantize_rows_int8(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())
    assert torch.equal(dequantize_rows_int8(q, s)[4], torch.zeros(70))


def test_forced_reference_via_env(monkeypatch):
    monkeypatch.setenv("EMBER_KERNELS", "reference")
    monkeypatch.setattr(cpu_extension, "_state", {})  # read when the kernels are first loaded
    assert cpu_extension.load() is None
    w, g = make("gelu_glu", 33, 13, "int8", seed=2)
    x = torch.randn(3, 33, generator=g)
    idx = torch.tensor([4, 1, 9])
    assert torch.equal(sparse_ffn(x, w, idx), reference(x, w, idx))
    assert torch.equal(sparse_ffn(x, w, torch.empty(0, dtype=torch.long)), torch.zeros(3, 33))
    assert not sparse_ffn_module.available()


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog):
    def broken_build():
        raise OSError("no compiler here")

    monkeypatch.delenv("EMBER_KERNELS", raising=False)
    monkeypatch.setattr(cpu_extension, "_state", {})
    monkeypatch.setattr(cpu_extension, "_build", broken_build)
    w, g = make("relu", 7, 13, seed=4)
    x = torch.randn(1, 7, generator=g)
    idx = torch.tensor([0, 12])
    with caplog.at_level(logging.WARNING, logger="ember.kernels"):
        for _ in range(3):
            assert torch.equal(sparse_ffn(x, w, idx), reference(x, w, idx))
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
    assert "no compiler here" in cpu_extension.unavailable_reason()


@pytest.mark.parametrize("op", (sparse_ffn_reference, sparse_ffn))
def test_bad_inputs_raise_clear_errors(op):
    w, g = make("relu_glu", 33, 13, seed=8)
    x = torch.randn(1, 33, generator=g)
    with pytest.raises(ValueError, match="x must be"):
        op(torch.randn(1, 32), w, torch.tensor([0]))
    with pytest.raises(ValueError, match="active_idx"):
        op(x, w, torch.tensor([0.5]))
    with pytest.raises(IndexError):
        op(x, w, torch.tensor([13]))


def test_weights_validate_themselves():
    up, down = torch.randn(13, 33), torch.randn(33, 13)
    with pytest.raises(ValueError, match="unknown activation"):
        SparseFFNWeights.from_rows(None, up, down.t(), "swish")
    with pytest.raises(ValueError, match="needs a gate"):
        SparseFFNWeights.from_rows(None, up, down.t(), "relu_glu")
    with pytest.raises(ValueError, match="takes no gate"):
        SparseFFNWeights.from_rows(up, up, down.t(), "relu")
    with pytest.raises(ValueError, match="dtype"):
        SparseFFNWeights.from_rows(None, up, down.t(), "relu", dtype="int4")
    with pytest.raises(ValueError, match="down_nm"):
        SparseFFNWeights.from_rows(None, up, down[:, :5].t(), "relu")
    w = SparseFFNWeights.from_rows(up, up, down.t(), "silu_glu", dtype="int8")
    assert (w.hidden, w.ffn) == (33, 13) and w.nbytes() == 3 * 13 * 33 + 3 * 13 * 4
    assert torch.equal(w.down_nm, quantize_rows_int8(down.t())[0])


@pytest.mark.parametrize("dtype", ("fp32", "int8"))
@pytest.mark.parametrize("act", ("relu_glu", "relu2"))
def test_each_neuron_is_one_contiguous_bundle(act, dtype):
    # The layout the kernel relies on: neuron i's rows (then, int8, its scales) back to back
    # in packed[i], and the public row/scale tensors are views into it, not copies.
    gate, up, down_nm = (torch.randn(13, 33) for _ in range(3))
    w = SparseFFNWeights.from_rows(gate if is_gated(act) else None, up, down_nm, act, dtype)
    rows = ([w.gate] if is_gated(act) else []) + [w.up, w.down_nm]
    scales = ([w.gate_scale] if is_gated(act) else []) + [w.up_scale, w.down_scale]
    p, size = w.packed, w.packed.element_size()
    for j, (r, s) in enumerate(zip(rows, scales)):
        assert r.data_ptr() == p.data_ptr() + j * 33 * size and r.stride() == (p.shape[1], 1)
        assert torch.equal(p[4, j * 33:(j + 1) * 33], r[4])
        if dtype == "int8":
            assert s.data_ptr() - p.data_ptr() < p.shape[1]  # in neuron 0's bundle
        else:
            assert s is None
    want = up if dtype == "fp32" else quantize_rows_int8(up)[0]
    assert torch.equal(w.up, want)
    with pytest.raises(ValueError, match="packed"):
        SparseFFNWeights(act, dtype, p[:, :-1].contiguous(), 33)


def test_big_bundle_buffers_start_on_a_huge_page():
    big = empty_bundles(4096, 1040, torch.int8)  # over 2 huge pages: aligned (and madvised)
    assert big.shape == (4096, 1040) and big.is_contiguous() and big.data_ptr() % (2 << 20) == 0
    assert empty_bundles(3, 16, torch.float32).shape == (3, 16)


def test_bench_kernels_is_a_cli_command():
    from ember.app.cli import build_parser

    args = build_parser().parse_args(["bench", "kernels", "--json", "--shape", "gemma3-270m"])
    assert args.handler == "bench_kernels" and args.shape == "gemma3-270m"


V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize("flags, env, name", [
    (V4, "", "ember_cpu_kernels_v4"),
    (V4, "v3", "ember_cpu_kernels_v3"),       # EMBER_BUILD=v3: what AVX2-only CPUs run
    (V4 - {"avx512_vnni"}, "", "ember_cpu_kernels_v3"),
    (V3, "", "ember_cpu_kernels_v3"),
    (V3 - {"fma"}, "", "ember_cpu_kernels_generic"),
])
def test_the_build_matches_the_cpu(flags, env, name, monkeypatch):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: set(flags))
    monkeypatch.setenv("EMBER_BUILD", env)
    got, cflags = cpu_extension.build_flags()
    assert got == name
    assert ("-march=x86-64-v4" in cflags) == name.endswith("v4")
    assert ("-march=x86-64-v3" in cflags) == name.endswith("v3")


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """torch's own `lock` file, left by a killed build, is removed once Ember holds its
    builder lock (the next run would otherwise wait for it forever)."""
    from ember.kernels.cpu_extension import _builder_lock

    (tmp_path / "lock").touch()
    with _builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
