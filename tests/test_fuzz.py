"""Hostile model files: mutated tiny GGUF files and HF folders either work or raise EmberError.

Hypothesis picks (mutator, seed) pairs for each seed model; the mutators are in
`tests/fuzz_mutators.py` and the judging harness (time limit, memory bound) in
`tests/fuzz_harness.py`, both shared with the 10,000-case run `bench/fuzz_models.py`.
Derandomized, so CI sees the same cases every time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.models.support.errors import ModelFormatError
from ember.models.loader import load_model, open_model

from .fuzz_harness import memory_bound, run_case
from .fuzz_mutators import (SEED_KINDS, build_seeds, gguf_layout, mutate_case, mutators_for,
                            replace_value)

EXAMPLES_PER_KIND = 50  # x 5 seed models = 250 cases
CASE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    paths = build_seeds(tmp_path_factory.mktemp("fuzz-seeds"))
    for path in paths.values():  # warm up: imports are not a case's memory growth
        assert run_case(path).status == "ok"
    return paths


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-work") / "case"


def _check(outcome, case) -> None:
    where = f"case {case}: {outcome.error}\n{outcome.detail}"
    assert outcome.status in ("ok", "rejected"), where
    assert outcome.memory_ratio <= 1.0, where


@pytest.mark.parametrize("kind", SEED_KINDS)
@settings(max_examples=EXAMPLES_PER_KIND, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_model_works_or_is_rejected(kind, seeds, work, data):
    mutator = data.draw(st.sampled_from(mutators_for(kind)), label="mutator")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    path = mutate_case(seeds[kind], kind, mutator, seed, work)
    _check(run_case(path, timeout=CASE_TIMEOUT_S), (kind, mutator, seed))


def test_every_mutator_changes_the_file(seeds, work):
    """A mutator that silently does nothing would make the fuzz run look better than it is."""
    for kind in SEED_KINDS:
        for mutator in mutators_for(kind):
            path = mutate_case(seeds[kind], kind, mutator, 1, work)
            files = [path] if path.is_file() else sorted(path.iterdir())
            before = [seeds[kind]] if path.is_file() else sorted(seeds[kind].iterdir())
            changed = [a.read_bytes() != b.read_bytes() for a, b in zip(files, before)]
            assert len(files) != len(before) or any(changed), (kind, mutator)


def test_layout_finds_the_header_fields(seeds):
    layout = gguf_layout(seeds["gguf-f32"].read_bytes())
    assert len(layout.of_kind("offset")) == len(layout.tensor_offsets) > 10
    assert "gemma3.block_count" in layout.values


def test_memory_bound_scales_with_the_file():
    assert memory_bound(1 << 20) == 128 << 20


# ---- the bugs the fuzzer found, each pinned by the smallest input that shows it -----------


def test_tokenizer_json_that_is_not_json(tiny_models, tmp_path):
    """Found by tokenizer_json (truncation, bit flips): tokenizers raised a bare Exception."""
    folder = _copy_hf(tiny_models, tmp_path)
    tok = folder / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:100])
    with pytest.raises(ModelFormatError, match="tokenizer.json.*not a valid tokenizer.json"):
        open_model(folder)


def test_deeply_nested_config_json(tiny_models, tmp_path):
    """Found by config_bytes (nest): json raised RecursionError."""
    folder = _copy_hf(tiny_models, tmp_path)
    (folder / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ModelFormatError, match="config.json: JSON nested too deeply"):
        open_model(folder)
    (folder / "config.json").write_text(json.dumps(_hf_config(tiny_models)))
    (folder / "tokenizer_config.json").write_text("[" * 100_000)
    assert open_model(folder).chat_template is None  # an optional file: ignored


def test_zero_query_pre_attn_scalar(tiny_models, tmp_path):
    """Found by config_edit: 0 ** -0.5 raised ZeroDivisionError."""
    folder = _copy_hf(tiny_models, tmp_path)
    (folder / "config.json").write_text(json.dumps({**_hf_config(tiny_models),
                                                    "query_pre_attn_scalar": 0}))
    with pytest.raises(ModelFormatError, match="'query_pre_attn_scalar' must be positive"):
        open_model(folder)


@pytest.mark.parametrize("window", [10**30, 0])
def test_impossible_sliding_window_in_config_json(tiny_models, tmp_path, window):
    """Found by config_edit (cases 3808, 5328, 6648 of the 10,000-case run): a window of 10**30
    overflowed the attention mask arithmetic (OverflowError) at the first forward pass."""
    folder = _copy_hf(tiny_models, tmp_path)
    (folder / "config.json").write_text(json.dumps({**_hf_config(tiny_models),
                                                    "sliding_window": window}))
    with pytest.raises(ModelFormatError, match="sliding window sizes must be between 1"):
        open_model(folder)


def test_huge_head_dim_in_config_json(tiny_models, tmp_path):
    """Found by config_edit (case 2208 of the long run): head_dim 10**30 overflowed torch.empty
    in the rotary tables (TypeError) before any weight shape was compared."""
    folder = _copy_hf(tiny_models, tmp_path)
    (folder / "config.json").write_text(json.dumps({**_hf_config(tiny_models),
                                                    "head_dim": 10**30}))
    with pytest.raises(ModelFormatError, match="'head_dim' must be between 1 and 2147483647"):
        open_model(folder)


def test_rope_scaling_factor_of_the_wrong_type(tiny_models, tmp_path):
    folder = _copy_hf(tiny_models, tmp_path)
    scaling = {"rope_type": "linear", "factor": [2]}
    (folder / "config.json").write_text(json.dumps({**_hf_config(tiny_models),
                                                    "rope_scaling": scaling}))
    with pytest.raises(ModelFormatError, match="'rope_scaling.factor' should be float"):
        open_model(folder)


@pytest.mark.parametrize("key, value, message", [
    ("gemma3.attention.key_length", 0, "key_length' must be between 1 and 2147483647, got 0"),
    ("gemma3.block_count", 2**32 - 1, "block_count' must be between 1 and 4096"),
    ("gemma3.attention.sliding_window", 0, "sliding window sizes must be between 1 and 2..31 - 1, got 0"),
])
def test_impossible_sizes_in_gguf(tiny_models, tmp_path, key, value, message):
    """Found by meta_value: head_dim 0 raised ZeroDivisionError; 2**32 - 1 layers built a
    4-billion-entry tuple (minutes and gigabytes) before ModelConfig could object."""
    path = tmp_path / "m.gguf"
    data = bytearray(tiny_models["gemma3"][2].read_bytes())
    type_at, _ = gguf_layout(bytes(data)).values[key]
    struct.pack_into("<I", data, type_at + 4, value)  # both are uint32 values
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match=message):
        open_model(path)


def test_scores_that_are_strings(tiny_models, tmp_path):
    """Found by retype: a string array as tokenizer.ggml.scores raised ValueError while
    fingerprinting the vocabulary."""
    data = bytearray(tiny_models["gemma3"][2].read_bytes())
    replace_value(data, gguf_layout(bytes(data)), "tokenizer.ggml.scores", 9, (8, ["a"] * 365))
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="items of metadata 'tokenizer.ggml.scores'"):
        open_model(path)


def _copy_hf(tiny_models, tmp_path):
    import shutil

    return shutil.copytree(tiny_models["gemma3"][3], tmp_path / "hf")


def _hf_config(tiny_models) -> dict:
    return json.loads((tiny_models["gemma3"][3] / "config.json").read_text())
