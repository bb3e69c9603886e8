"""The CLI: instant help, machine-readable output, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ember.app.cli import main
from ember.models.testing import synthetic


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_does_not_import_torch():
    code = ("import sys\nfrom ember.app.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "generate" in res.stdout


def test_generate_json_on_tiny_model(capsys, tiny_gemma_gguf):
    code, out, err = _run(capsys, "generate", "the cat", "--model", str(tiny_gemma_gguf),
                          "--temperature", "0", "--max-tokens", "5", "--json", "--ignore-eos")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["token_ids"]) == 5
    assert result["prompt_token_ids"][0] == 2
    assert result["finish_reason"] == "length"
    for key in ("text", "ttft_s", "decode_tokens_per_s"):
        assert key in result


def test_generate_is_reproducible_with_seed(capsys, tiny_gemma_gguf):
    args = ["generate", "the", "--model", str(tiny_gemma_gguf), "--max-tokens", "8", "--json",
            "--seed", "3", "--temperature", "1.0", "--ignore-eos"]
    first = json.loads(_run(capsys, *args)[1])["token_ids"]
    assert first == json.loads(_run(capsys, *args)[1])["token_ids"]


def test_tokenize_prints_ids_with_bos(capsys, tiny_gemma_gguf):
    code, out, _ = _run(capsys, "tokenize", "the", "--model", str(tiny_gemma_gguf), "--json")
    assert code == 0 and json.loads(out)["ids"][0] == 2


def test_info_json(capsys, tiny_gemma_gguf):
    code, out, _ = _run(capsys, "info", "--model", str(tiny_gemma_gguf), "--json")
    info = json.loads(out)
    assert code == 0 and info["architecture"] == "gemma3" and info["layers"] == 6
    assert set(info["stored_bytes"]) >= {"embeddings", "attention", "ffn"}


def test_perplexity_json(capsys, tiny_gemma_gguf, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat is in the hat and the dog is on the log. " * 12)
    code, out, err = _run(capsys, "perplexity", str(text), "--model", str(tiny_gemma_gguf),
                          "--ctx-size", "64", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] > 64 and result["ppl"] > 1


def _bad_inputs(tmp_path, tiny):
    cfg, weights, gguf_path, _ = tiny
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, I am not a model")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(gguf_path.read_bytes()[:3000])
    from dataclasses import replace
    alien = synthetic.write_gguf(tmp_path / "alien.gguf", replace(cfg, architecture="mamba"), weights)
    return {"missing": tmp_path / "nope.gguf", "not_gguf": not_gguf, "truncated": truncated,
            "header_cut": header_cut, "unsupported_arch": alien}


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated", "header_cut", "unsupported_arch"])
def test_bad_model_files_exit_2_with_one_line(capsys, tmp_path, tiny_models, case):
    path = _bad_inputs(tmp_path, tiny_models["gemma3"])[case]
    code, out, err = _run(capsys, "generate", "hi", "--model", str(path))
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("ember: loading")]
    assert len(lines) == 1 and lines[0].startswith("ember: error:"), err
    assert "Traceback" not in err


def test_unsupported_quant_type_exit_2(capsys, tmp_path, tiny_models):
    from gguf import GGMLQuantizationType as Q

    from .gguf_tools import relabel_tensor_type

    cfg, weights, _, _ = tiny_models["gemma3"]
    path = synthetic.write_gguf(tmp_path / "iq.gguf", cfg, weights, qtype=Q.Q4_0)
    relabel_tensor_type(path, "blk.0.ffn_up.weight", Q.IQ4_NL)  # same block geometry as Q4_0
    code, out, err = _run(capsys, "generate", "hi", "--model", str(path), "--max-tokens", "1")
    assert code == 2 and "IQ4_NL" in err and "blk.0.ffn_up.weight" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["generate", ""], "prompt is empty"),
    (["generate", "   "], "prompt is empty"),
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "x", "--top-p", "2"], "top-p"),
    (["generate", "x", "--max-tokens", "0"], "max tokens"),
    (["generate", "x", "--threads", "0"], "threads"),
])
def test_bad_arguments_exit_2(capsys, tiny_gemma_gguf, argv, needle):
    code, _, err = _run(capsys, *argv, "--model", str(tiny_gemma_gguf))
    assert code == 2 and needle in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--weights", "q8"], "--weights q8: removed: the default runtime (--weights auto) reads "
                          "the file's own blocks"),
    (["--weights", "q4"], "unknown --weights 'q4'; choose one of auto, fp32"),
])
def test_a_removed_or_unknown_weights_choice_says_what_to_use(capsys, tiny_gemma_gguf, argv,
                                                              needle):
    code, _, err = _run(capsys, "generate", "x", *argv, "--model", str(tiny_gemma_gguf))
    assert code == 2 and needle in err, err


@pytest.mark.parametrize("head", ["q8_0", "fp32"])
def test_the_removed_lm_head_choices_say_what_to_use(capsys, tiny_gemma_gguf, head):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--lm-head", head, "--model", str(tiny_gemma_gguf)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "removed" in err and "--weights fp32" in err, err


def test_prompt_longer_than_context_exit_2(capsys, tiny_gemma_gguf):
    code, _, err = _run(capsys, "generate", "the cat sat " * 200, "--model", str(tiny_gemma_gguf))
    assert code == 2 and "context" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("text", ["repeated", "prose"])
def test_bench_decode_reports_drafters_beside_plain(capsys, tiny_gemma_gguf, text):
    code, out, err = _run(capsys, "bench", "decode", "--model", str(tiny_gemma_gguf), "--runs", "2",
                          "--prompt-tokens", "12", "--gen-tokens", "6", "--speculate", "lookup",
                          "self", "--text", text, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["text"] == text and report["ember"]["decode"]["median"] > 0
    for name in ("ember+lookup", "ember+self"):
        assert report[name]["identical_to_plain"] is True
        assert report[name]["mean_accepted_length"] >= 1.0
        assert report[name]["speedup_over_plain"] > 0
    assert "llama.cpp" not in report and "ratio_ember_over_llama_cpp" not in report
    # The kernel path the figures belong to, among those this build and CPU can run.
    from ember.kernels import block_matmul as bm

    cpu = report["ember"]["cpu"]
    assert cpu["path"] == bm.cpu_path() and cpu["paths"] == list(bm.cpu_paths())
    assert cpu["path"] in cpu["paths"] or cpu["path"] == "reference"


def test_bench_decode_refuses_a_prompt_longer_than_its_text(capsys, tiny_gemma_gguf):
    code, _, err = _run(capsys, "bench", "decode", "--model", str(tiny_gemma_gguf),
                        "--text", "prose", "--prompt-tokens", "100000")
    assert code == 2 and "--prompt-tokens" in err, err


def test_generate_parses_special_tokens_in_the_prompt_unless_no_special(capsys, tiny_gemma_gguf):
    sot = synthetic.CONTROL.index("<start_of_turn>")
    args = ["generate", "<start_of_turn>the", "--model", str(tiny_gemma_gguf), "--json",
            "--max-tokens", "1", "--temperature", "0"]
    parsed = json.loads(_run(capsys, *args)[1])["prompt_token_ids"]
    assert parsed[:2] == [2, sot]
    literal = json.loads(_run(capsys, *args, "--no-special")[1])["prompt_token_ids"]
    assert sot not in literal and len(literal) > len(parsed)


def test_generate_chat_names_its_format(capsys, tiny_gemma_gguf):
    base = ["generate", "hi", "--model", str(tiny_gemma_gguf), "--json", "--max-tokens", "2",
            "--temperature", "0", "--chat"]
    assert json.loads(_run(capsys, *base)[1])["chat_format"] == "transcript"
    out = json.loads(_run(capsys, *base, "--chat-format", "gemma")[1])
    sot = synthetic.CONTROL.index("<start_of_turn>")
    assert out["chat_format"] == "gemma" and out["prompt_token_ids"].count(sot) == 2


def test_chat_format_flag_errors_are_one_line(capsys, tiny_gemma_gguf):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--chat", "--chat-format", "alpaca"])
    assert exc.value.code == 2 and "invalid choice: 'alpaca'" in capsys.readouterr().err
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tiny_gemma_gguf),
                        "--chat-format", "gemma")
    assert code == 2 and "--chat-format needs --chat" in err
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tiny_gemma_gguf), "--chat",
                        "--chat-format", "chatml")
    assert code == 2 and "needs the <|im_start|> token" in err


def test_info_names_the_chat_format(capsys, tiny_gemma_gguf):
    code, out, _ = _run(capsys, "info", "--model", str(tiny_gemma_gguf), "--json")
    chat = json.loads(out)["chat_format"]
    assert chat["auto"] == "transcript" and "gemma" in chat["available"]
    assert "chatml" not in chat["available"]
    _, out, _ = _run(capsys, "info", "--model", str(tiny_gemma_gguf))
    assert "chat format     transcript (no chat template in the file" in out


@pytest.mark.slow
def test_bench_context_reports_each_length_and_the_attention_against_its_bounds(
        capsys, tiny_q4_k_m):
    code, out, err = _run(capsys, "bench", "context", "--model", str(tiny_q4_k_m[2]),
                          "--prompt-tokens", "20", "70", "--gen-tokens", "3", "--kv-type", "q8_0",
                          "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["prompt_tokens"] == [20, 70] and report["kv_type"] == "torch.uint8"
    for n in ("20", "70"):
        assert report["ember"][n]["prefill"]["median"] > 0
        attention = report["ember"][n]["decode_attention"]
        assert attention["kv_bytes_per_token"] > 0 and attention["over_bound"] > 0
        assert attention["ms_per_token"] > 0 and attention["in_cache_ms_per_token"] > 0
    assert report["ember_decode_over_its_own_at_shortest"]["20"] == 1.0
    assert "llama.cpp" not in report
