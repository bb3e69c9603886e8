"""Split GGUF files (`NAME-00001-of-0000N.gguf`, as gguf-split and the Hugging Face hub keep
large models) open by their first part and run as the one file they were split from."""

from __future__ import annotations

import pytest
import torch

from ember.models.testing import synthetic
from ember.models.support.errors import ModelFormatError
from ember.models.gguf_file import GGUFFile
from ember.models.gguf_split import model_stem, part_number
from ember.models.loader import load_model, open_model


@pytest.fixture(scope="module")
def whole_and_split(tmp_path_factory):
    """(config, the unsplit file, the first of its parts): the same tiny SwiGLU llama."""
    root = tmp_path_factory.mktemp("split")
    cfg = synthetic.tiny_config(arch="llama", activation="silu_glu")
    weights = synthetic.tiny_weights(cfg, seed=3)
    whole = synthetic.write_gguf(root / "whole.gguf", cfg, weights)
    first = synthetic.write_gguf(root / "model.gguf", cfg, weights, split_tensors=7)
    return cfg, whole, first


def test_parts_are_named_as_gguf_split_names_them(whole_and_split):
    _, _, first = whole_and_split
    assert first.name == "model-00001-of-00005.gguf"
    assert part_number(first) == (1, 5)
    assert part_number(first.with_name("model-00005-of-00005.gguf")) == (5, 5)
    assert part_number(first.with_name("model-00006-of-00005.gguf")) is None
    assert part_number(first.with_name("model.gguf")) is None
    assert model_stem(first) == "model"


def test_split_reads_as_the_whole_file(whole_and_split):
    _, whole, first = whole_and_split
    one, parts = GGUFFile(whole), GGUFFile(first)
    assert len(parts.parts) == 5 and len(one.parts) == 1
    assert parts.tensors.keys() == one.tensors.keys()
    assert {t.part for t in parts.tensors.values()} == set(range(5))
    for name in one.tensors:
        assert bytes(parts.raw(name)) == bytes(one.raw(name)), name
    assert parts.nbytes == sum(p.stat().st_size for p in first.parent.glob("model-*.gguf"))
    assert parts.metadata["general.architecture"] == "llama"


def test_split_model_computes_what_the_whole_does(whole_and_split):
    _, whole, first = whole_and_split
    ids = torch.tensor([1, 5, 7, 9, 11])
    a, b = load_model(whole).model, load_model(first).model
    torch.testing.assert_close(a.logits(a.hidden(ids, a.new_cache(8))),
                               b.logits(b.hidden(ids, b.new_cache(8))), rtol=0, atol=0)


def test_split_model_runs_from_ram_and_the_map_alike(whole_and_split):
    """The engine on the file's own blocks, the parts read into RAM or memory-mapped."""
    from ember.offload.runtime.engine import Engine, EngineOptions

    _, whole, first = whole_and_split
    logits = []
    for path, mmap in ((whole, "on"), (first, "on"), (first, "off")):
        engine = Engine.load(path, EngineOptions(device="cpu", n_ctx=64, threads=1, mmap=mmap))
        logits.append(engine.runner.prefill("s", [1, 5, 7, 9]))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    torch.testing.assert_close(logits[2], logits[0], rtol=0, atol=0)


def test_split_fingerprint_covers_every_part(whole_and_split, tmp_path):
    _, _, first = whole_and_split
    copy = tmp_path / "c"
    copy.mkdir()
    for p in first.parent.glob("model-*.gguf"):
        (copy / p.name).write_bytes(p.read_bytes())
    before = open_model(copy / first.name).fingerprint
    last = copy / "model-00005-of-00005.gguf"
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # one bit of the last part's weights
    last.write_bytes(bytes(data))
    assert open_model(copy / first.name).fingerprint != before


def test_later_part_says_which_to_open(whole_and_split):
    _, _, first = whole_and_split
    with pytest.raises(ModelFormatError, match=r"part 3 of 5 .*model-00001-of-00005.gguf"):
        GGUFFile(first.with_name("model-00003-of-00005.gguf"))


def test_missing_part_is_named(whole_and_split, tmp_path):
    _, _, first = whole_and_split
    for p in first.parent.glob("model-*.gguf"):
        if p.name != "model-00004-of-00005.gguf":
            (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ModelFormatError, match="part 4 of 5 is missing: model-00004"):
        GGUFFile(tmp_path / first.name)


def test_renamed_first_part_cannot_find_the_others(whole_and_split, tmp_path):
    _, _, first = whole_and_split
    (tmp_path / "renamed.gguf").write_bytes(first.read_bytes())
    with pytest.raises(ModelFormatError, match="the other parts cannot be found"):
        GGUFFile(tmp_path / "renamed.gguf")


def test_part_from_another_split_is_refused(whole_and_split, tmp_path):
    """A part whose own split.no disagrees with its name (files mixed up) is refused."""
    _, _, first = whole_and_split
    for p in first.parent.glob("model-*.gguf"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    two, three = (tmp_path / f"model-0000{i}-of-00005.gguf" for i in (2, 3))
    data2, data3 = two.read_bytes(), three.read_bytes()
    two.write_bytes(data3)
    three.write_bytes(data2)
    with pytest.raises(ModelFormatError, match="named as part 2 of 5"):
        GGUFFile(tmp_path / first.name)
