"""`ember bench startup` on a tiny Q4_K_M model, and the EMBER_REPORT_TIMINGS hook of
`ember generate` it reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ember.app.cli import main
from ember.app.commands.startup_prompt import prompt_of_length
from ember.app.process_clock import REPORT_ENV, TimingsReport, seconds_since_start
from ember.models.support.errors import EmberError


def _bench(path, *extra) -> dict:
    """Run the bench as its own small process: a child's peak RSS starts from its parent's,
    so running it inside pytest (torch loaded) would inflate every figure."""
    res = subprocess.run([sys.executable, "-m", "ember.app.cli", "bench", "startup", str(path),
                          "--runs", "1", "--max-tokens", "4", "--ctx-size", "64", "--json",
                          *extra], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def report(tiny_q4_k_m):
    return _bench(tiny_q4_k_m[2])


def test_report_sizes_and_prompt(report, tiny_q4_k_m):
    cfg, _, path = tiny_q4_k_m
    assert report["file_bytes"] == os.path.getsize(path)
    # One 64-token context of K and V on every layer, float16 as the CPU runtime holds them.
    assert report["kv_cache_bytes"] == 2 * cfg.n_layers * 64 * cfg.n_kv_heads * cfg.head_dim * 2
    assert report["file_plus_kv_bytes"] == report["file_bytes"] + report["kv_cache_bytes"]
    assert report["prompt_tokens"] == 16 and len(report["prompt_ids"]) == 16
    assert report["ember"]["prompt_ids_match"] is True
    assert report["threads"] == 2 and report["ctx_size"] == 64 and report["runs"] == 1
    assert "warm" in report["page_cache"]
    assert report["cpu"]["model"] and isinstance(report["cpu"]["avx512_vnni"], bool)
    assert "llama.cpp" not in report and "ratio_ember_over_llama_cpp" not in report


def test_report_times_and_memory_are_sane(report):
    floor, ember = report["import_torch"], report["ember"]
    for entry in (floor, ember):
        for key in ("wall_s", "peak_rss_bytes"):
            assert 0 < entry[key]["min"] <= entry[key]["median"] <= entry[key]["max"]
        # Each child runs Python and imports torch: far above the small bench process.
        assert entry["peak_rss_bytes"]["median"] > 2 * report["parent_rss_bytes"]
    assert report["parent_rss_bytes"] < 100 * 2**20
    first = ember["first_token_s"]["median"]
    # Ember imports torch before its first token.
    assert floor["wall_s"]["median"] * 0.5 < first <= ember["wall_s"]["median"]
    assert ember["generated_tokens"] == 4
    assert ember["first_token_minus_import_torch_s"] == pytest.approx(
        first - floor["wall_s"]["median"])
    assert ember["rss_over_file_plus_kv"] == pytest.approx(
        ember["peak_rss_bytes"]["median"] / report["file_plus_kv_bytes"])


def test_beside_llama_cpp(tiny_q4_k_m):
    pytest.importorskip("llama_cpp", reason="the [baseline] extra is not installed")
    report = _bench(tiny_q4_k_m[2], "--against", "llama.cpp")
    llama, ember = report["llama.cpp"], report["ember"]
    assert llama["generated_tokens"] == 4
    assert 0 < llama["first_token_s"]["median"] <= llama["wall_s"]["median"]
    assert llama["peak_rss_bytes"]["median"] > 0
    ratio = report["ratio_ember_over_llama_cpp"]
    for key in ("peak_rss_bytes", "first_token_s", "wall_s"):
        assert ratio[key] == pytest.approx(ember[key]["median"] / llama[key]["median"])
    assert "--ids" in report["commands"]["llama.cpp"]


def _error(capsys, *argv) -> str:
    code = main(["bench", "startup", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    return err


def test_bad_input_is_one_line(capsys, tiny_q4_k_m, tmp_path):
    path = str(tiny_q4_k_m[2])
    assert "no such file or folder" in _error(capsys, str(tmp_path / "missing.gguf"))
    assert "--runs must be at least 1" in _error(capsys, path, "--runs", "0")
    assert "--ctx-size 8 cannot hold" in _error(capsys, path, "--ctx-size", "8")


def test_missing_llama_cpp_is_a_clear_error(capsys, tiny_q4_k_m, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    err = _error(capsys, str(tiny_q4_k_m[2]), "--against", "llama.cpp")
    assert "pip install" in err and "[baseline]" in err


def test_bench_process_stays_small():
    """The bench must not import torch itself (see `_bench`)."""
    code = ("import sys\nimport ember.app.commands.bench_startup\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_prompt_of_length_cuts_words_then_characters():
    def one_per_word(text):
        return [1] + [7] * len(text.split())

    assert prompt_of_length(one_per_word, 4, "a b c d e") == "a b c"

    def two_per_word(text):  # a word boundary never lands on an odd count
        words = text.split(" ")
        return [1] + [7] * (2 * (len(words) - 1)) + [7] * min(2, len(words[-1]))

    assert prompt_of_length(two_per_word, 4, "ab cd ef") == "ab c"
    with pytest.raises(EmberError, match="tokenizes to 9 tokens"):
        prompt_of_length(one_per_word, 9, "a b c")


def test_seconds_since_start_counts_from_process_start():
    code = ("import time\ntime.sleep(0.3)\n"
            "from ember.app.process_clock import seconds_since_start\n"
            "print(seconds_since_start())\n")
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t
    since = float(res.stdout)
    assert 0.3 <= since <= wall + 0.011  # /proc's start time is in 10 ms ticks


def test_generate_reports_first_token_time(capsys, tiny_gemma_gguf, tmp_path, monkeypatch):
    path = tmp_path / "timings.json"
    monkeypatch.setenv(REPORT_ENV, str(path))
    before = seconds_since_start()
    code = main(["generate", "the cat", "--model", str(tiny_gemma_gguf), "--temperature", "0",
                 "--max-tokens", "3", "--ignore-eos", "--json"])
    after = seconds_since_start()
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    times = json.loads(path.read_text())
    assert before < times["first_token_s"] < after
    assert times["generated_tokens"] == 3 == len(out["token_ids"])
    assert times["prompt_tokens"] == len(out["prompt_token_ids"])


def test_timings_report_only_with_the_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(REPORT_ENV, raising=False)
    assert TimingsReport.from_env() is None
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "t.json"))
    report = TimingsReport.from_env()
    report.mark("first_token")
    first = report.times["first_token_s"]
    report.mark("first_token")  # the first mark stays
    report.write(n=1)
    assert json.loads((tmp_path / "t.json").read_text()) == {"first_token_s": first, "n": 1}
