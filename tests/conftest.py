"""Shared fixtures: tiny synthetic models written once per session, the default model."""

from __future__ import annotations

import os

import pytest
import torch

from ember.models.testing import synthetic

# The GPU tier's Triton kernels run in Triton's interpreter on a machine without CUDA (their
# tests opt in with EMBER_TIER_TRITON=cpu). Triton takes that mode when it is first imported,
# and PyTorch's optimizers import it, so the mode is set for the whole session here
# (kernels/triton_support.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_KINDS = {
    "gemma3": dict(arch="gemma3"),
    "llama-relu_glu": dict(arch="llama", activation="relu_glu"),
    "llama-silu_glu": dict(arch="llama", activation="silu_glu"),
    "llama-drelu": dict(arch="llama", activation="drelu"),
    "llama-relu": dict(arch="llama", activation="relu"),
}


def pytest_sessionstart(session):
    """Tests that need the C++ kernels skip on a machine that cannot build them (no compiler:
    Ember then runs on the PyTorch reference). With a compiler, a failed build is a bug in the
    kernels' sources, and skipping those tests would hide it: stop the run and say why."""
    import shutil

    from ember.kernels import cpu_extension

    if cpu_extension.forced_reference() or not shutil.which(os.environ.get("CXX", "c++")):
        return
    if cpu_extension.load() is None:
        pytest.exit("the C++ kernels did not build, though a compiler is here: "
                    f"{cpu_extension.unavailable_reason()} (EMBER_KERNELS=reference runs the "
                    "tests on the PyTorch fallback alone)", returncode=1)


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Derived files of the hundreds of tiny and mutated models tests open (tokenizer caches)
    go to a private cache directory, not the user's. The assembled default model and the
    compiled kernels are shared from the real one by links, so they are not rebuilt."""
    from ember.models.support.user_dirs import cache_dir

    real, private = cache_dir(), tmp_path_factory.mktemp("xdg-cache")
    (private / "ember").mkdir()
    for shared in ("models", "torch_extensions"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (private / "ember" / shared).symlink_to(real / shared)
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(private))
    yield private
    patch.undo()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (config, weights, gguf path, hf folder) for each tiny architecture."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for seed, (name, kw) in enumerate(TINY_KINDS.items()):
        cfg = synthetic.tiny_config(**kw)
        weights = synthetic.tiny_weights(cfg, seed=seed)
        gguf_path = synthetic.write_gguf(root / f"{name}.gguf", cfg, weights)
        hf_dir = synthetic.write_hf(root / f"{name}-hf", cfg, weights)
        out[name] = (cfg, weights, gguf_path, hf_dir)
    return out


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """name -> (config, weights, gguf path) for each of synthetic.FAMILY_CONFIGS (Llama 3
    RoPE scaling, Qwen 2, Qwen 3, Gemma 2, Phi-3), F32 tensors with confident logits (see
    synthetic.confident_weights)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for seed, name in enumerate(synthetic.FAMILY_CONFIGS, start=100):
        cfg = synthetic.tiny_config(name)
        weights = synthetic.confident_weights(cfg, synthetic.tiny_weights(cfg, seed=seed), seed)
        out[name] = (cfg, weights, synthetic.write_gguf(root / f"{name}.gguf", cfg, weights))
    return out


def q4_k_m_mix(name: str) -> int:
    """A Q4_K_M-style mix: Q6_K for the output matrix, V and down projections, Q4_K elsewhere
    (real files alternate V/down between the two by layer; both types are what matters)."""
    from gguf import GGMLQuantizationType as Q

    if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")):
        return int(Q.Q6_K)
    return int(Q.Q4_K)


@pytest.fixture(scope="session")
def tiny_q4_k_m(tmp_path_factory):
    """(config, float weights, path) of a small SwiGLU llama stored as Q4_K/Q6_K blocks: the
    types of a Q4_K_M file, at shapes K-quants accept (rows of 256 values)."""
    cfg = synthetic.tiny_config(arch="llama", activation="silu_glu", hidden_size=256,
                                ffn_size=512, head_dim=64, n_heads=4, n_kv_heads=2,
                                name="tiny-llama-q4_k_m")
    weights = synthetic.tiny_weights(cfg, seed=7)
    path = synthetic.write_gguf(tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf", cfg,
                                weights, qtype=q4_k_m_mix)
    return cfg, weights, path


@pytest.fixture
def restore_path():
    """The block kernels' CPU path as it was before the test (tests switch paths)."""
    from ember.kernels import block_matmul as bm

    before = bm.cpu_path() if bm.available() else None
    yield
    if before is not None:
        bm.set_cpu_path(before)


@pytest.fixture(scope="session")
def tiny_gemma_gguf(tiny_models):
    return tiny_models["gemma3"][2]


@pytest.fixture(scope="session")
def default_model_path():
    from ember.models.default_model import default_model_path as path

    return path()


@pytest.fixture(scope="session")
def default_engine(default_model_path):
    from ember.offload.runtime.engine import Engine, EngineOptions

    return Engine.load(default_model_path, EngineOptions(device="cpu", n_ctx=2048, threads=2))


@pytest.fixture(scope="session")
def default_greedy_reference(default_model_path):
    """The default model unsplit on one prompt: (loaded model, prompt ids, 12 greedy tokens,
    each step's top-two logit gap), the reference the split and tier-attention runs of it
    are held to until a near tie."""
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    from .near_ties import greedy_with_gaps

    loaded = load_model(default_model_path)
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=256, threads=2))
    try:
        ids = dense.encode("The capital of France is")
        want, gaps = greedy_with_gaps(dense, ids, 12)
    finally:
        dense.close()
    return loaded, ids, want, gaps


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """Every test starts with the SIGINT handler the previous one found: a handler left
    changed (e.g. ignored) would be inherited by the subprocesses later tests start."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not handler and handler is not None:
        signal.signal(signal.SIGINT, handler)


def pytest_configure(config):
    # Tests must never fetch anything: the default model ships as a package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


# Fixtures that load a real model (seconds each, and the tests using them run it): every
# test that takes one is slow.
SLOW_FIXTURES = {"default_model_path", "default_engine", "default_greedy_reference"}
# Modules whose tests start processes, servers or terminals (live server load, kill -9, a
# pty, start-up timing, the fuzz runs, the chat app driven through Textual's pilot): slow
# whatever model they use.
SLOW_MODULES = {"test_serve_live", "test_serve_load", "test_tui_kill9", "test_bench_startup",
                "test_interrupts", "test_soak", "test_fuzz", "test_serve_fuzz",
                "test_tui_real_model", "test_tui_chat", "test_tui_snapshots",
                "test_tui_engine_view", "test_tui_status", "test_tui_models"}


def pytest_collection_modifyitems(config, items):
    """`pytest -m "not slow"` is the loop to run while working (under a minute with the
    C++ kernels built); CI runs everything. Besides tests marked slow by hand, a test is slow
    when it takes a real model's fixture or lives in a module that starts processes."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
