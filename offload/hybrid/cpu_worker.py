"""The CPU side's worker thread: cold-neuron FFN work runs here while the caller drives the
GPU tier, so the two sides overlap instead of taking turns.

One long-lived thread (not one per token: starting a thread costs more than a small layer's
cold work). The C++ kernel releases the GIL, so the caller's thread keeps issuing GPU-tier
work meanwhile. A job's exception is re-raised in the caller by `Future.result()`.

Ctrl-C arrives in the main thread, usually while it waits on a job; the job in flight is at
most one layer's cold work (milliseconds), the worker finishes it and stays usable, and
`close()` stops the thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class CpuWorker:
    def __init__(self, name: str = "ember-cold-ffn"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError("the CPU worker is closed")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Stop the thread after the job in flight (queued jobs are cancelled)."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
