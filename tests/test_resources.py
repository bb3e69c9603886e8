"""The memory check before loading: too little RAM is a clear error with the numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.models.loader import open_model
from ember.models.summary import summarize
from ember.offload.runtime import resources
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.runtime.resources import GIB, InsufficientMemoryError


def _available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(resources.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=nbytes))


def test_too_little_ram_is_refused_before_the_weights_are_built(monkeypatch, tiny_gemma_gguf):
    _available(monkeypatch, 100 << 20)
    built = []
    monkeypatch.setattr("ember.models.loader.Transformer", lambda *a: built.append(a))
    with pytest.raises(InsufficientMemoryError) as err:
        Engine.load(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=256))
    message = str(err.value)
    assert "GiB of RAM" in message and "0.10 GiB is available" in message
    assert "try a smaller --ctx-size or a smaller model" in message
    assert not built


def test_the_need_counts_weights_kv_pools_and_the_allowance(monkeypatch, tiny_gemma_gguf):
    source = open_model(tiny_gemma_gguf)
    options = EngineOptions(device="cpu", n_ctx=256)
    weights = summarize(source, 256)["memory"]["weights_fp32_bytes"]
    from ember.offload.kv.plan import plan_kv

    from ember.offload.body.file_blocks_model import kv_dtype

    cpu = resources.resolve_device("cpu")
    pools = plan_kv(source.config, 256, value_bytes=kv_dtype(options, cpu).itemsize).to_dict()
    need = weights + pools["device_bytes"] + pools["host_bytes"] + resources.RUNTIME_ALLOWANCE
    _available(monkeypatch, need)
    resources.check_memory(source, options, resources.resolve_device("cpu"))  # just fits
    _available(monkeypatch, need - 1)
    with pytest.raises(InsufficientMemoryError, match=f"needs {need / GIB:.2f} GiB of RAM"):
        resources.check_memory(source, options, resources.resolve_device("cpu"))


def test_a_smaller_context_needs_less(monkeypatch, tiny_gemma_gguf):
    source = open_model(tiny_gemma_gguf)
    needs = []

    def record(what, need, available, detail):
        needs.append(need)

    monkeypatch.setattr(resources, "_require", record)
    for n_ctx in (256, 16):
        resources.check_memory(source, EngineOptions(n_ctx=n_ctx), resources.resolve_device("cpu"))
    assert needs[1] < needs[0]


def test_gpu_memory_is_checked_on_cuda(monkeypatch, tiny_gemma_gguf):
    import torch

    source = open_model(tiny_gemma_gguf)
    _available(monkeypatch, 64 * GIB)
    monkeypatch.setattr(resources.torch.cuda, "mem_get_info", lambda device: (1 << 20, 8 * GIB))
    with pytest.raises(InsufficientMemoryError, match="GPU memory on cuda"):
        resources.check_memory(source, EngineOptions(n_ctx=256), torch.device("cuda"))


def test_a_gpu_budget_is_checked_instead_of_the_whole_model(monkeypatch, tiny_gemma_gguf):
    """With --gpu-budget only the budget must fit the GPU (the plan keeps within it): a
    small GPU can hold the hot part of a model that does not fit it whole."""
    import torch

    source = open_model(tiny_gemma_gguf)
    _available(monkeypatch, 64 * GIB)
    monkeypatch.setattr(resources.torch.cuda, "mem_get_info", lambda device: (1 << 20, 8 * GIB))
    resources.check_memory(source, EngineOptions(n_ctx=256, gpu_budget=1 << 19), torch.device("cuda"))
    with pytest.raises(InsufficientMemoryError, match="lower it"):
        resources.check_memory(source, EngineOptions(n_ctx=256, gpu_budget=2 << 20),
                               torch.device("cuda"))


def test_enough_memory_loads(tiny_gemma_gguf):
    engine = Engine.load(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=64))
    assert engine.n_ctx == 64


def test_the_cli_prints_one_line_and_exits_2(monkeypatch, tiny_gemma_gguf, capsys):
    from ember.app.cli import main

    _available(monkeypatch, 1 << 20)
    code = main(["generate", "hello", "--model", str(tiny_gemma_gguf), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "ember: error: the model needs" in err and "Traceback" not in err


def test_the_default_context_is_the_trained_length_when_ram_holds_it(tiny_gemma_gguf):
    import torch

    source = open_model(tiny_gemma_gguf)
    size = resources.context_size(source, EngineOptions(device="cpu"), torch.device("cpu"),
                                  available=64 * GIB)
    assert (size.tokens, size.limit) == (source.config.context_length, "model")
    asked = resources.context_size(source, EngineOptions(device="cpu", n_ctx=64),
                                   torch.device("cpu"), available=64 * GIB)
    assert (asked.tokens, asked.limit) == (64, "asked")


def test_the_default_context_is_capped_so_both_kv_pools_fit_in_the_free_ram(tiny_models):
    """A model trained for a long context on a machine with little RAM: the largest context
    (a multiple of 256) whose device and host pools take at most KV_RAM_SHARE of what the
    weights leave."""
    import dataclasses

    import torch

    from ember.models.testing import synthetic
    from ember.offload.kv.plan import plan_kv

    cfg = dataclasses.replace(synthetic.tiny_config(arch="llama", activation="silu_glu"),
                              context_length=1 << 16)
    path = synthetic.write_gguf(tiny_models["gemma3"][2].parent / "long.gguf", cfg,
                                synthetic.tiny_weights(cfg, seed=1))
    source = open_model(path)
    options, cpu = EngineOptions(device="cpu"), torch.device("cpu")
    weights = resources._weights_held(source, options, cpu)[0]
    one = plan_kv(source.config, 4096, value_bytes=2)
    per_context = one.min_device_blocks * one.block_bytes  # 4096 tokens on every layer
    available = weights + resources.RUNTIME_ALLOWANCE + int(2 * 2 * per_context / resources.KV_RAM_SHARE)
    size = resources.context_size(source, options, cpu, available=available)
    assert size.limit == "memory" and size.tokens == 2 * 4096
    assert size.tokens % resources.CONTEXT_STEP == 0
