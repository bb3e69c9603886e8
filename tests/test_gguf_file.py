"""The validating GGUF reader: malformed files are ModelFormatErrors naming file and field."""

from __future__ import annotations

import struct

import pytest

from ember.models.support.errors import ModelFormatError, UnsupportedModelError
from ember.models.gguf_file import GGUFFile

from .gguf_tools import patch_u64_after_name, relabel_tensor_type


@pytest.fixture
def good(tiny_gemma_gguf, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gemma_gguf.read_bytes())
    return path


def test_reads_metadata_and_directory(good):
    f = GGUFFile(good)
    assert f.architecture == "gemma3"
    assert f.field("gemma3.block_count", int) == 6
    assert f.tensors["token_embd.weight"].shape[1] == 64
    assert f.raw("token_embd.weight").nbytes == f.tensors["token_embd.weight"].nbytes


def test_wrong_metadata_type_names_the_key(good):
    with pytest.raises(ModelFormatError, match="'gemma3.block_count' should be str"):
        GGUFFile(good).field("gemma3.block_count", str)


@pytest.mark.parametrize("cut", [3, 10, 30, 200, 2000])
def test_truncated_header(good, cut):
    good.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(ModelFormatError):
        GGUFFile(good)


def test_bad_magic_and_version(good):
    data = bytearray(good.read_bytes())
    good.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(good)
    struct.pack_into("<I", data, 4, 99)
    good.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="version 99"):
        GGUFFile(good)


def test_huge_counts_are_rejected_before_allocating(good):
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, 16, 2**62)  # metadata count
    good.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="needs"):
        GGUFFile(good)


def test_huge_string_length_rejected(good):
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, 24, 2**60)  # length of the first metadata key
    good.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="needs"):
        GGUFFile(good)


def test_tensor_past_end_of_file(good):
    patch_u64_after_name(good, "token_embd.weight", "offset", 2**40)
    with pytest.raises(ModelFormatError, match="token_embd.weight"):
        GGUFFile(good)


def test_tensor_shape_larger_than_file(good):
    patch_u64_after_name(good, "token_embd.weight", "dim0", 2**61)
    with pytest.raises(ModelFormatError, match="token_embd.weight"):
        GGUFFile(good)


def test_overlapping_tensors(good):
    f = GGUFFile(good)
    first = min(f.tensors.values(), key=lambda t: t.offset)
    second = sorted(f.tensors.values(), key=lambda t: t.offset)[1]
    patch_u64_after_name(good, second.name, "offset", first.offset - f.data_offset)
    with pytest.raises(ModelFormatError, match="overlap"):
        GGUFFile(good)


def test_unknown_tensor_type(good):
    relabel_tensor_type(good, "output_norm.weight", 250)
    with pytest.raises(UnsupportedModelError, match="unknown type id 250"):
        GGUFFile(good)


def test_row_not_multiple_of_block(tmp_path, tiny_models):
    from gguf import GGMLQuantizationType as Q

    from ember.models.testing import synthetic

    cfg, weights, _, _ = tiny_models["gemma3"]
    path = synthetic.write_gguf(tmp_path / "q.gguf", cfg, weights, qtype=Q.Q8_0)
    relabel_tensor_type(path, "blk.0.ffn_down.weight", Q.Q4_K)  # rows of 128 < 256-element blocks
    with pytest.raises(ModelFormatError, match="not a multiple of the Q4_K block size"):
        GGUFFile(path)


def test_impossible_hyper_parameters_are_format_errors(tmp_path, tiny_models):
    from dataclasses import replace

    from ember.models.testing import synthetic
    from ember.models.loader import open_model

    cfg, weights, _, _ = tiny_models["gemma3"]
    bad = object.__new__(type(cfg))  # bypass validation to write an impossible file
    object.__setattr__(bad, "__dict__", {**replace(cfg).__dict__, "n_kv_heads": 3})
    path = synthetic.write_gguf(tmp_path / "bad.gguf", bad, weights)
    with pytest.raises(ModelFormatError, match="n_heads .4. must be a multiple of n_kv_heads .3."):
        open_model(path)
