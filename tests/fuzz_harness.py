"""Run one mutated model through Ember and judge the outcome (shared by the test and bench/).

Acceptable outcomes: the model opens, loads and runs a forward pass ("ok"), or Ember refuses it
with an `EmberError` ("rejected"). Anything else is a bug: another exception ("crash"), running
past the time limit ("hang"), or memory growth above `memory_bound` ("memory").
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
import tracemalloc
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

# Imported here, not inside a case: an import cut short by the time limit leaves torch half
# registered and every later case failing, and import memory is not the case's growth.
from ember.models.support.errors import EmberError
from ember.models.loader import load_model, open_model

MIB = 1 << 20


def memory_bound(input_bytes: int) -> int:
    """Most memory one case may add: 64 x the input size + 64 MiB.

    Why 64x: loading dequantizes every matrix to fp32, 4 bytes per element; the densest quant
    Ember reads (Q2_K, 84 bytes per 256 elements) grows 12x that way, and `_matrix` briefly
    holds the (out, in) copy and its transposed copy (24x). The tokenizer conversion is
    proportional to the vocabulary, itself bounded by the file. 64x leaves 2.5x headroom over
    the worst honest case; the 64 MiB covers fixed costs (torch workspaces, the tokenizers
    library's tables, 256-position rotary tables).
    """
    return 64 * input_bytes + 64 * MIB


@dataclass
class Outcome:
    status: str  # ok, rejected, crash, hang, memory
    error: str = ""  # exception type and message (first line)
    detail: str = ""  # traceback tail for crashes
    seconds: float = 0.0
    peak_python_bytes: int = 0  # tracemalloc peak during the case
    peak_rss_delta: int = 0  # sampled RSS peak minus RSS before the case
    input_bytes: int = 0

    @property
    def memory_ratio(self) -> float:
        """Peak growth as a fraction of the bound (1.0 = at the bound)."""
        grown = max(self.peak_python_bytes, self.peak_rss_delta)
        return grown / memory_bound(self.input_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "memory_ratio": round(self.memory_ratio, 4)}


class CaseTimeout(BaseException):
    """Raised by SIGALRM; a BaseException, so no `except Exception` under test swallows it."""


@contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise CaseTimeout(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class PeakRSS:
    """Samples this process's RSS in a thread; `peak` is the largest value seen.

    Sampling every millisecond misses only spikes shorter than that; tracemalloc catches the
    Python and numpy side of those exactly.
    """

    def __init__(self, interval: float = 0.001):
        self._proc, self._interval = psutil.Process(), interval
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def input_size(path: Path) -> int:
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size if path.exists() else 0


def exercise(path: Path) -> None:
    """open_model; if that works, load_model and a forward pass over the first prompt tokens."""
    open_model(path)
    lm = load_model(path)
    ids = lm.tokenizer.encode("the cat", add_bos=True)[:3]
    cache = lm.model.new_cache(min(8, lm.config.context_length))
    lm.model(torch.tensor(ids[: cache.max_len], dtype=torch.long), cache)


def run_case(path: Path, timeout: float = 20.0) -> Outcome:
    """Run `exercise(path)` with a time limit, measuring memory growth."""
    outcome = Outcome("ok", input_bytes=input_size(path))
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    try:
        with PeakRSS() as rss, time_limit(timeout):
            try:
                exercise(path)
            except EmberError as exc:
                outcome.status, outcome.error = "rejected", _first_line(exc)
            except (CaseTimeout, KeyboardInterrupt):
                raise
            # The bug this harness exists to find; BaseException too, because a Rust panic in
            # a library surfaces as pyo3's PanicException, which is not an Exception.
            except BaseException as exc:
                outcome.status, outcome.error = "crash", _first_line(exc)
                outcome.detail = "".join(traceback.format_exc(limit=-6))[-3000:]
    except CaseTimeout as exc:
        outcome.status, outcome.error = "hang", str(exc)
    outcome.seconds = time.perf_counter() - t0
    outcome.peak_python_bytes = tracemalloc.get_traced_memory()[1]
    outcome.peak_rss_delta = max(0, rss.peak - rss.start)
    if started:
        tracemalloc.stop()
    if outcome.status in ("ok", "rejected") and outcome.memory_ratio > 1.0:
        outcome.status = "memory"
    return outcome


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]
