"""Build (once, lazily) and load the C++ CPU kernels; fall back cleanly when that fails.

The extension is JIT-compiled with `torch.utils.cpp_extension.load` (needs `ninja` and a C++
compiler) into `$TORCH_EXTENSIONS_DIR`, or `~/.cache/ember/torch_extensions` (XDG honoured).
Later processes reuse the cached build. On a CPU with AVX-512 (F/BW/VL) and VNNI it is
compiled for x86-64-v4 (and holds block_matmul's "avx512" path besides the others); with
AVX2/FMA/F16C for x86-64-v3; otherwise portable -O3. `EMBER_BUILD=v3` asks for the AVX2 build
on an AVX-512 machine (to test exactly what AVX2-only CPUs run). The builds have different
names, so a cache shared between different machines never loads the wrong one.

If anything goes wrong, one warning is logged and `load()` returns None: callers use the
PyTorch reference instead. `EMBER_KERNELS=reference` forces that fallback without building.
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import threading
from contextlib import contextmanager
from pathlib import Path

from ember.models.support.user_dirs import cache_dir as user_cache_dir

log = logging.getLogger("ember.kernels")

_SOURCES = ("bindings.cpp", "sparse_ffn.cpp", "q8_0_matmul.cpp", "fused_ops.cpp",
            "select.cpp", "block_matmul.cpp", "block_paths.cpp", "decoder_step.cpp",
            "input_sparse.cpp", "tile_relayout.cpp", "attention.cpp", "kv_pool.cpp")
_V3_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}  # x86-64-v3 needs these
# x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) plus VNNI: the build with block_matmul's "avx512" path
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
_lock = threading.Lock()
_state: dict = {}  # "module" once tried: the module or None; "error": why it is None
_UNSET = object()


def forced_reference() -> bool:
    return os.environ.get("EMBER_KERNELS", "").strip().lower() == "reference"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flags() -> tuple[str, list[str]]:
    """(extension name, C++ flags) for this machine."""
    # -fopenmp is what makes at::parallel_for parallel: ATen's OpenMP backend is inline header
    # code, and without the flag its `#pragma omp parallel` compiles to a serial loop (the
    # kernels ran on one thread until this was found). The extension then links libgomp.so.1,
    # which resolves to the copy torch already loaded: one OpenMP runtime, one thread pool.
    base = ["-O3", "-fopenmp", "-ffp-contract=fast"]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = _cpu_flags()
    if x86 and _V4_FLAGS <= flags and os.environ.get("EMBER_BUILD", "").strip() != "v3":
        # 256-bit vectors where the compiler vectorizes on its own, as in the v3 build: the
        # 512-bit code is the hand-written kernels'.
        return "ember_cpu_kernels_v4", base + ["-march=x86-64-v4", "-mavx512vnni",
                                               "-mprefer-vector-width=256"]
    if x86 and _V3_FLAGS <= flags:
        return "ember_cpu_kernels_v3", base + ["-march=x86-64-v3"]
    return "ember_cpu_kernels_generic", base


def cache_dir() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    return user_cache_dir() / "torch_extensions"


def _build():
    from torch.utils import cpp_extension

    name, flags = build_flags()
    src = Path(__file__).resolve().parent / "csrc"
    out = cache_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    with _builder_lock(out):
        return cpp_extension.load(name=name, sources=[str(src / s) for s in _SOURCES],
                                  extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=str(out), verbose=False)


@contextmanager
def _builder_lock(out: Path):
    """One Ember process builds at a time, under an OS lock the kernel releases when its
    holder dies. torch marks a build in progress with a plain `lock` file and waits for it
    to go; a build killed midway (Ctrl-C on the first run) leaves that file behind, and every
    later run would wait forever. Holding this lock means no other Ember process is
    building, so such a file is stale and is removed."""
    # an empty file that only carries the lock: nothing is written to it
    fd = os.open(out / "ember-build.lock", os.O_CREAT | os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def load():
    """The compiled module, or None (reference fallback). Builds on first call; thread-safe.

    EMBER_KERNELS is read on that first call too: this runs a few hundred times per decoded
    token, where even an environment lookup shows up."""
    module = _state.get("module", _UNSET)
    if module is not _UNSET:
        return module
    with _lock:
        if "module" not in _state and forced_reference():
            _state["module"] = None
        elif "module" not in _state:
            try:
                _state["module"] = _build()
            except Exception as exc:  # compiler missing, ninja missing, build error: never crash
                _state["module"] = None
                _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[-500:]}"
                log.warning("ember: C++ CPU kernels unavailable, using the PyTorch reference "
                            "(slower): %s", _state["error"])
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why load() returns None (after it was tried), else None."""
    if forced_reference():
        return "EMBER_KERNELS=reference"
    return _state.get("error")
