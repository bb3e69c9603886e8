"""Ctrl-C: `ember generate` exits 130 with one line, no traceback, no half-written files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ember.models.testing import synthetic

# Long enough that generation is still running when the signal arrives, whatever the machine.
CONTEXT = 20_000


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    cfg = synthetic.tiny_config("llama", activation="relu_glu", context_length=CONTEXT)
    folder = tmp_path_factory.mktemp("interrupt")
    return synthetic.write_gguf(folder / "tiny.gguf", cfg, synthetic.tiny_weights(cfg, seed=3))


def _start(model) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ember.app.cli", "generate", "the", "--model", str(model),
           "--device", "cpu", "--threads", "1", "--ctx-size", str(CONTEXT), "--max-tokens",
           str(CONTEXT - 8), "--ignore-eos", "--temperature", "1", "--seed", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A child inherits an ignored SIGINT, and Python then keeps ignoring it: start the child
    # with the default disposition whatever the test process did to its own.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(stream, predicate, timeout: float) -> bytes:
    """Bytes read from `stream` until predicate(bytes so far) holds; fails after `timeout`."""
    seen = bytearray()
    done = threading.Event()

    def read():
        while not predicate(bytes(seen)):
            chunk = os.read(stream.fileno(), 1)
            if not chunk:
                break
            seen.extend(chunk)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout):
        pytest.fail(f"timed out waiting; saw {bytes(seen)!r}")
    return bytes(seen)


def _interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("still running 60 s after SIGINT")
    return proc.returncode, err.decode(errors="replace")


def test_ctrl_c_during_generation(long_context_model):
    proc = _start(long_context_model)
    _wait_for(proc.stdout, lambda b: len(b) >= 8, timeout=120)  # tokens are streaming
    time.sleep(0.2)
    code, err = _interrupt(proc)
    assert code == 130, err
    assert "Traceback" not in err
    assert err.rstrip().endswith("ember: interrupted")


def test_ctrl_c_during_load(long_context_model, tmp_path):
    """The signal lands as soon as the CLI says it is loading: while the model is opened, the
    tokenizer converted and its cache written (a fresh copy has no cache yet)."""
    model = tmp_path / "fresh.gguf"
    model.write_bytes(long_context_model.read_bytes())
    proc = _start(model)
    _wait_for(proc.stderr, lambda b: b"loading model" in b, timeout=120)
    code, err = _interrupt(proc)
    assert code == 130, err
    assert "Traceback" not in err
    # An interrupted atomic write leaves the old file or nothing: no temporary files behind.
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_interrupted_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    from ember.models.support import atomic

    path = tmp_path / "settings.json"
    atomic.atomic_write_text(path, "old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]


def test_ember_writes_files_only_through_atomic(request):
    """Audit: outside models/support/atomic.py (and the test-model writer), no runtime code opens a file
    for writing, so every file Ember writes is temp file + fsync + rename."""
    import ast
    from pathlib import Path

    root = Path(request.config.rootpath)
    allowed = {root / "models" / "support" / "atomic.py", root / "models" / "testing" / "synthetic.py"}
    offenders = []
    for package in ("app", "offload", "models", "predictors", "placement", "kernels"):
        for path in (root / package).rglob("*.py"):
            if path in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if _writes(node):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders


def _writes(node) -> bool:
    """A call that writes a file: .write_text/.write_bytes, or open() with a w/a/x mode."""
    import ast

    if not isinstance(node, ast.Call):
        return False
    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
    if name in ("write_text", "write_bytes", "save_file"):
        return True
    if name == "open":
        modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "mode"]
        return any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax") for m in modes)
    return False
