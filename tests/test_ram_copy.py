"""Weights read into RAM on huge pages (--mmap off) instead of the memory map: the same bytes,
the same results, and the choice made where the user expects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.models import ram_copy
from ember.models.support.errors import ConfigError, ModelFormatError
from ember.models.gguf_file import GGUFFile
from ember.models.loader import load_model, open_model
from ember.offload.body import file_blocks_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.runtime.resources import RAM_COPY_SHARE, reads_weights_into_ram
from ember.offload.options.sampling import GREEDY

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(not file_blocks_model.applies(),
                                  reason="C++ kernels not built on this machine")


def test_a_file_read_into_ram_holds_its_exact_bytes(tmp_path, monkeypatch):
    # Small chunks: several reads, shared by the reader threads, and a short last one.
    monkeypatch.setattr(ram_copy, "CHUNK_BYTES", 4096)
    data = np.random.default_rng(0).integers(0, 256, 10 * 4096 + 123, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    seen = []
    copy = ram_copy.read_into_ram(path, data.size, lambda done, size: seen.append((done, size)))
    assert np.array_equal(copy, data)
    assert len(seen) == 11 and max(seen) == (data.size, data.size)


def test_a_file_shorter_than_promised_is_a_clear_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(ModelFormatError, match="file ended at byte 100 of 200"):
        ram_copy.read_into_ram(path, 200)


def test_tensors_of_a_gguf_in_ram_equal_the_mapped_ones(tiny_q4_k_m):
    mapped, copied = GGUFFile(tiny_q4_k_m[2]), GGUFFile(tiny_q4_k_m[2])
    copied.read_into_ram()
    assert copied.in_ram and not mapped.in_ram
    for name in mapped.tensors:
        assert np.array_equal(mapped.raw(name), copied.raw(name)), name
    # The copy is not the map: it is anonymous memory, not the file's pages.
    assert not isinstance(copied.raw(name).base, np.memmap)


@needs_native
def test_an_engine_on_weights_in_ram_decodes_the_same_tokens(tiny_q4_k_m):
    path = tiny_q4_k_m[2]
    runs = {}
    for mmap in ("on", "off"):
        engine = Engine.load(path, EngineOptions(n_ctx=64, threads=1, mmap=mmap))
        assert engine.loaded.source.weights.in_ram == (mmap == "off")
        done = engine.generate([2, 40, 41, 42, 43], sampling=GREEDY, max_tokens=12,
                               ignore_eos=True)
        runs[mmap] = done.token_ids
    assert runs["on"] == runs["off"]


def test_load_model_asks_after_the_memory_check(tiny_q4_k_m):
    """A refusal by the check copies nothing; the copy is asked for with the opened source."""
    order = []

    def check(source):
        order.append("check")

    def in_ram(source):
        order.append("in_ram")
        return True

    loaded = load_model(tiny_q4_k_m[2], check=check, in_ram=in_ram)
    assert order == ["check", "in_ram"] and loaded.source.weights.in_ram


def test_reading_weights_into_ram_parses_the_file_once(tiny_q4_k_m, monkeypatch):
    """The copy reuses the opened file's tensor table: its header (the whole vocabulary on a
    262k-token model) is not read a second time."""
    from ember.models import loader

    opened = []

    class CountingGGUFFile(GGUFFile):
        def __init__(self, path):
            opened.append(path)
            super().__init__(path)

    monkeypatch.setattr(loader, "GGUFFile", CountingGGUFFile)
    loaded = load_model(tiny_q4_k_m[2], in_ram=lambda source: True)
    assert loaded.source.weights.in_ram and len(opened) == 1


def test_auto_copies_a_file_that_fits_easily_and_maps_one_that_does_not(tiny_q4_k_m):
    source = open_model(tiny_q4_k_m[2])
    size = source.weights.total_bytes()
    auto = EngineOptions(mmap="auto")
    if not file_blocks_model.runs_on_file_blocks(auto, CPU):
        pytest.skip("C++ kernels not built: the engine builds the float model")
    assert reads_weights_into_ram(source, auto, CPU, available=int(size / RAM_COPY_SHARE) + 1)
    assert not reads_weights_into_ram(source, auto, CPU, available=size)
    # Asked for explicitly, either way; the float model never takes a copy it would not read.
    assert reads_weights_into_ram(source, EngineOptions(mmap="off"), CPU, available=size)
    assert not reads_weights_into_ram(source, EngineOptions(mmap="on"), CPU, available=10 * size)
    assert not reads_weights_into_ram(source, EngineOptions(mmap="off", weights="fp32"), CPU)
    # A split engine reads its FFNs from rows it derives: a copy of the file would hold the
    # FFN tensors for nothing, where the map never brings them in.
    split = EngineOptions(mmap="auto", gpu_budget=1 << 20, split="cpu-only", profile=None)
    assert not reads_weights_into_ram(source, split, CPU, available=100 * size)


def test_an_unknown_mmap_choice_is_refused():
    with pytest.raises(ConfigError, match="unknown --mmap 'no'"):
        EngineOptions(mmap="no")


def test_a_store_with_tensors_replaced_still_says_where_its_bytes_live(tiny_q4_k_m):
    """Phi-3's fused tensors are split into views by `replaced`: still the RAM copy's bytes."""
    from ember.models.weights import WeightStore

    f = GGUFFile(tiny_q4_k_m[2])
    f.read_into_ram()
    store = WeightStore.from_gguf(f)
    first = store.names()[0]
    assert store.replaced({first: None}).in_ram


def test_a_platform_without_the_copy_keeps_the_map(tiny_q4_k_m, monkeypatch):
    source = open_model(tiny_q4_k_m[2])
    monkeypatch.setattr(ram_copy, "supported", lambda: False)
    for choice in ("auto", "off"):
        assert not reads_weights_into_ram(source, EngineOptions(mmap=choice), CPU,
                                          available=1 << 40)
