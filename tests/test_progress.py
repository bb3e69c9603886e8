"""Progress bars (app/progress.py): drawn on a terminal, silent under --json or a redirect;
the lower layers' progress callbacks (loading, profile stages, predictor epochs); and
`ember bench decode` on a real pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from ember.app.progress import (EMPTY, FILL, NoProgress, ProgressBar, StageBars, progress_bar,
                                progress_wanted)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _screen(text: str) -> list[str]:
    """What a terminal shows: each line as last redrawn after its carriage returns."""
    return [line.split("\r")[-1].rstrip() for line in text.split("\n")]


def test_bar_shows_fraction_stage_rate_and_time_left():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("loading", tty, delay=0.5, clock=clock)
    clock.now += 10
    bar(0.25, "layer 4 of 16")
    line = _screen(tty.getvalue())[-1]
    assert line.startswith("loading  " + FILL * 5 + EMPTY * 15 + "   25%")
    # 25% in 10 s: 2.5 %/s, and 30 s to go at that pace.
    assert "layer 4 of 16 · 2.5 %/s · 30 s left" in line
    clock.now += 30
    bar(1.0, "layer 16 of 16")
    bar.close()
    assert tty.getvalue().endswith("\n")
    assert _screen(tty.getvalue())[-2].endswith("· done")


def test_rate_in_the_works_own_unit():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("bench", tty, total=6, unit="runs", delay=0, clock=clock)
    clock.now += 4
    bar(2 / 6, "run 2 of 3")
    assert "0.5 runs/s" not in tty.getvalue()  # slower than one a second: seconds per run
    assert "2.0 s/run · 8 s left" in _screen(tty.getvalue())[-1]
    clock.now += 200
    bar(3 / 6)
    assert "3:24 left" in _screen(tty.getvalue())[-1]


def test_quick_work_leaves_no_trace_and_redraws_are_throttled():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("loading", tty, delay=0.5, clock=clock)
    for f in (0.2, 0.6, 1.0):  # all within the delay
        bar(f, "x")
    bar.close()
    assert tty.getvalue() == ""
    bar = ProgressBar("work", tty, delay=0, clock=clock)
    for i in range(100):  # 100 updates within 50 ms: drawn once, not 100 times
        clock.now += 0.0005
        bar(i / 200)
    assert tty.getvalue().count("\r") == 1


def test_bar_never_runs_backwards_and_a_shorter_line_blanks_the_longer():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("w", tty, delay=0, clock=clock)
    clock.now += 1
    bar(0.5, "a long description of the stage")
    clock.now += 1
    bar(0.3, "short")
    first, second = tty.getvalue().split("\r")[1:3]
    assert "50%" in second and len(second) >= len(first)


def test_a_narrow_terminal_shortens_the_description_not_the_figures():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("predictors", tty, delay=0, columns=70, clock=clock)
    clock.now += 10
    bar(0.5, "layer 3 of 18, rank 64, epoch 12 of 20")
    line = _screen(tty.getvalue())[-1]
    assert len(line) <= 70 and line.endswith("· 5.0 %/s · 10 s left")
    assert "layer 3" in line and "…" in line


def test_write_prints_a_line_above_the_bar():
    tty, clock = FakeTTY(), Clock()
    bar = ProgressBar("profile", tty, delay=0, clock=clock)
    clock.now += 1
    bar(0.5)
    bar.write("ember: layer 3 done")
    screen = _screen(tty.getvalue())
    assert screen[0] == "ember: layer 3 done"
    assert screen[1].startswith("profile  ")


def test_stage_bars_give_each_stage_its_line():
    tty, clock = FakeTTY(), Clock()
    bars = StageBars(tty, delay=0, columns=120, clock=clock)
    clock.now += 1
    bars(0.5, "calibration: 1024 tokens sampled")
    clock.now += 1
    bars(1.0, "calibration")
    bars(0.0, "predictors")
    clock.now += 2
    bars(0.25, "predictors: layer 1 of 4, rank 16, epoch 20")
    screen = _screen(tty.getvalue())
    assert len(screen) == 1  # one line, redrawn: the finished stage's bar is gone
    assert screen[0].startswith("predictors  " + FILL * 5)
    assert "layer 1 of 4, rank 16, epoch 20 · 12.5 %/s · 6 s left" in screen[0]
    assert "calibration  " + FILL * 20 in tty.getvalue()  # it was drawn, finished
    bars.write("ember: predictors: done")
    bars.close()
    assert _screen(tty.getvalue()) == ["ember: predictors: done", ""]


def test_progress_only_on_a_terminal_and_never_with_json(monkeypatch):
    tty, log = FakeTTY(), io.StringIO()
    monkeypatch.delenv("TERM", raising=False)
    assert progress_wanted(False, tty, tty)
    assert not progress_wanted(True, tty, tty)  # --json
    assert not progress_wanted(False, log, tty)  # stdout redirected
    assert not progress_wanted(False, tty, log)  # stderr redirected
    monkeypatch.setenv("TERM", "dumb")
    assert not progress_wanted(False, tty, tty)


def test_quiet_progress_draws_nothing_but_still_prints_lines(monkeypatch, capsys):
    bar = progress_bar("loading")  # capsys: neither stream is a terminal
    assert isinstance(bar, NoProgress)
    bar(0.5, "half")
    bar.write("a log line")
    bar.close()
    assert capsys.readouterr().err == "a log line\n"


# -- the callbacks the lower layers take ------------------------------------------------


def test_loading_reports_layers_then_ready(tiny_models):
    from ember.offload.runtime.engine import Engine, EngineOptions

    seen = []
    engine = Engine.load(tiny_models["llama-relu_glu"][2],
                         EngineOptions(device="cpu", n_ctx=64, weights="fp32"),
                         progress=lambda f, stage: seen.append((f, stage)))
    engine.close()
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and seen[-1] == (1.0, "ready")
    assert any(stage.startswith("layer 1 of") for _, stage in seen)


def test_loading_the_files_blocks_spends_the_bar_on_reading_the_file(tiny_q4_k_m):
    from ember.offload.runtime.engine import Engine, EngineOptions

    seen = []
    engine = Engine.load(tiny_q4_k_m[2], EngineOptions(device="cpu", n_ctx=64, mmap="off"),
                         progress=lambda f, stage: seen.append((f, stage)))
    engine.close()
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and seen[-1] == (1.0, "ready")
    reading = [f for f, stage in seen if stage.startswith("reading weights into RAM")]
    assert reading and reading[-1] > 0.9  # no float model is built: the read is the load


def test_predictor_training_reports_every_epoch_in_order(tiny_models):
    from ember.models.loader import load_model
    from ember.predictors.collect import collect
    from ember.predictors.train import TrainOptions, train_predictors

    loaded = load_model(tiny_models["llama-relu_glu"][2])
    ids = list(range(3, 300))
    seen = []
    collection = collect(loaded.model, ids, loaded.tokenizer.bos_id, length=64,
                         progress=lambda f, stage: seen.append(("collect", f, stage)))
    assert seen[-1][1:] == (1.0, f"segment {len(seen)} of {len(seen)}")
    seen.clear()
    opts = TrainOptions(epochs=3, ranks=(8, 16))
    train_predictors(collection, loaded.config, opts,
                     progress=lambda f, stage: seen.append((f, stage)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] <= 1.0
    layers = loaded.config.n_layers
    assert "epoch 1" in seen[0][1] and f"layer {layers} of {layers}" in seen[-1][1]
    # Every layer trains at least its first rank: at least layers x epochs reports.
    assert len(seen) >= layers * opts.epochs


def test_profile_reports_each_stage_from_start_to_end(tiny_models, tmp_path):
    from ember.models.loader import load_model
    from ember.offload.profile.profiler import ProfileOptions, run_profile

    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    loaded = load_model(tiny_models["llama-relu_glu"][2])
    seen = []
    run_profile(loaded, tmp_path / "p.safetensors",
                ProfileOptions(texts=(str(text),), epochs=1),
                progress=lambda f, stage: seen.append((f, stage)))
    stages = []
    for f, stage in seen:
        name = stage.partition(": ")[0]
        if not stages or stages[-1][0] != name:
            stages.append((name, []))
        stages[-1][1].append(f)
    names = [name for name, _ in stages]
    assert names == ["calibration", "statistics", "predictors", "costs", "placement", "check"]
    for name, fractions in stages:
        assert fractions[0] == 0.0 and fractions[-1] == 1.0, name
        assert fractions == sorted(fractions), name


# -- a real terminal ------------------------------------------------------------------


def _on_a_pty(args: list[str], timeout: float = 240) -> str:
    """Run `ember ARGS` with stdout and stderr on a pseudo-terminal; all it wrote."""
    main, child = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "ember.app.cli", *args], stdout=child,
                            stderr=child, stdin=subprocess.DEVNULL, env=env)
    os.close(child)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    proc.wait(30)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.slow
def test_bench_on_a_terminal_shows_a_bar_and_with_json_does_not(tiny_gemma_gguf):
    base = ["bench", "decode", "--model", str(tiny_gemma_gguf), "--runs", "2",
            "--prompt-tokens", "8", "--gen-tokens", "4", "--device", "cpu", "--threads", "1"]
    shown = _on_a_pty(base)
    assert "bench decode  " + FILL in shown, shown
    assert re.search(r"run 1 of 2 · \d+\.\d (runs/s|s/run) · \d+ s left", shown), shown
    assert "100%" in shown and shown.count("done") == 1
    quiet = _on_a_pty(base + ["--json"])
    assert FILL not in quiet and EMPTY not in quiet and "\r" not in quiet.replace("\r\n", "")
    assert '"runs": 2' in quiet
