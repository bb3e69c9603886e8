"""Derived files live under the user's cache directory, keyed by the model: opening a model
never writes beside it, and a read-only model folder works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.models.loader import file_fingerprint, open_model
from ember.models.gguf_vocab import tokenizer_cache_path
from ember.models.support.user_dirs import cache_dir

def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ember"
    fp = "0123456789abcdef" * 4
    assert tokenizer_cache_path(fp) == tmp_path / "xdg" / "ember" / "tokenizers" / (
        "0123456789abcdef01234567.tokenizer.json")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset (XDG spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ember"


def test_opening_a_model_writes_nothing_beside_it(tiny_gemma_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "models"
    folder.mkdir()
    model = Path(shutil.copy(tiny_gemma_gguf, folder / "tiny.gguf"))
    before = sorted(folder.iterdir())
    first = open_model(model)
    # A SentencePiece vocabulary is tokenized straight from its scores: nothing to cache.
    assert not tokenizer_cache_path(file_fingerprint(model)).exists()
    assert sorted(folder.iterdir()) == before
    again = open_model(model)
    text = "the cat is in the hat\n<start_of_turn>"
    assert again.tokenizer.encode(text, parse_special=True) == \
        first.tokenizer.encode(text, parse_special=True)
    assert sorted(folder.iterdir()) == before


_OPEN = ("import sys; from ember.models.loader import open_model; "
         "t = open_model(sys.argv[1]).tokenizer; print(t.encode('the cat', add_bos=False))")


def _open_in_read_only_folder(folder: Path, model: Path, env: dict) -> subprocess.CompletedProcess:
    """Open `model` in a subprocess that cannot write `folder`: permission bits for a normal
    user; root ignores those, so for root the folder is bind-mounted read-only in a private
    mount namespace (the mount vanishes with the process)."""
    cmd = [sys.executable, "-c", _OPEN, str(model)]
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    script = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && '
              'if touch "$0/.probe" 2>/dev/null; then exit 97; fi && exec "$@"')
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("running as root without unshare: cannot make a folder read-only")
    out = subprocess.run([unshare, "-m", "sh", "-c", script, str(folder), str(folder), *cmd],
                         env=env, capture_output=True, text=True, timeout=240)
    if out.returncode != 0 and "mount" in out.stderr and "python" not in out.stderr.lower():
        pytest.skip(f"running as root without mount rights: {out.stderr.strip()[:200]}")
    assert out.returncode != 97, "the read-only bind mount did not take"
    return out


@pytest.mark.slow
def test_read_only_model_folder(tiny_gemma_gguf, tmp_path):
    folder, cache = tmp_path / "models", tmp_path / "cache"
    folder.mkdir()
    model = Path(shutil.copy(tiny_gemma_gguf, folder / "tiny.gguf"))
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    try:
        out = _open_in_read_only_folder(folder, model, env)
    finally:
        os.chmod(folder, 0o755)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("[")
    assert [p.name for p in folder.iterdir()] == ["tiny.gguf"]
