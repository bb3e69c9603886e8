"""One engine, one thread: requests run one at a time, in the order they were queued.

The Engine is not thread-safe, so a single worker thread owns it; HTTP handlers only `submit`
jobs. A job's events (the engine's TokenEvents, then `Finished` or `Failed`) go back through
the job's `deliver` callable, called on the worker thread. The queue of waiting jobs is
bounded: when it is full `submit` raises `QueueFull` with a retry estimate. A job's `cancel`
event (set when its client disconnects) stops the engine before its next token, or skips the
job if it has not started.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ember.models.support.errors import EmberError
from ember.offload.decode.events import DoneEvent
from ember.offload.options.sampling import SamplingParams

from .sessions import SessionPicker

log = logging.getLogger("ember.serve")


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    deliver: Callable[[object], None]  # called on the worker thread, in order
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    dropped_messages: int = 0  # the conversation's oldest messages left out to fit the context
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass
class Finished:
    done: DoneEvent
    cached_tokens: int  # prompt tokens whose KV cache was reused rather than prefilled
    queued_s: float  # time spent waiting for the engine
    dropped_messages: int = 0  # the conversation's oldest messages left out to fit the context


@dataclass
class Failed:
    error: Exception  # an EmberError is the request's fault; anything else the server's


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class WorkerStats:
    finished: int = 0
    cancelled: int = 0  # cancelled while running, or skipped before starting
    failed: int = 0
    mean_job_s: float = 1.0  # a moving average, for Retry-After

    def record(self, seconds: float) -> None:
        self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * seconds


class EngineWorker:
    def __init__(self, engine, max_queue: int = 8, max_sessions: int = 16):
        """`engine`: an Engine (its stream() and conversations). `max_queue`: jobs that may wait while one
        runs; `max_sessions`: conversations whose KV cache is kept for reuse."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.sessions = SessionPicker(engine.conversation_tokens, engine.forget, max_sessions)
        self.stats = WorkerStats()
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    # -- the HTTP side -------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`; raises QueueFull when `max_queue` jobs already wait."""
        if self._closed:
            raise EmberError("the server is shutting down")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(self.retry_after_s()) from None

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely moved by one more job than now waits."""
        return max(1, math.ceil(self.stats.mean_job_s * (self.waiting + 1)))

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running job, fail the waiting ones and stop the thread."""
        self._closed = True
        running = self._running
        if running is not None:
            running.cancel.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _deliver(job, Failed(EmberError("the server is shutting down")))
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the engine's thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancel.is_set():  # its client left while it waited
                self.stats.cancelled += 1
                continue
            self._running = job
            start = time.perf_counter()
            try:
                self._run(job, queued_s=start - job.queued_at)
            finally:
                self._running = None
                self.stats.record(time.perf_counter() - start)

    def _run(self, job: Job, queued_s: float) -> None:
        session = None
        try:
            session = self.sessions.pick(job.prompt_ids)
            for event in self.engine.stream(job.prompt_ids, sampling=job.sampling,
                                            max_tokens=job.max_tokens, stop=job.stop,
                                            ignore_eos=job.ignore_eos, cancel=job.cancel,
                                            session=session):
                if isinstance(event, DoneEvent):
                    event = Finished(event, event.timings.cached_tokens, queued_s,
                                     job.dropped_messages)
                    if event.done.finish_reason == "cancelled":
                        self.stats.cancelled += 1
                    else:
                        self.stats.finished += 1
                if not _deliver(job, event):
                    job.cancel.set()  # nobody listens any more
        except EmberError as exc:  # a request the engine refused (a bad prompt or option)
            self.stats.failed += 1
            _deliver(job, Failed(exc))
        except Exception as exc:  # noqa: BLE001 - the server stays up; the log has the trace
            log.exception("generation failed")
            self.stats.failed += 1
            if session is not None:
                self.sessions.forget(session)  # its cache may be half written
            _deliver(job, Failed(exc))


def _deliver(job: Job, item) -> bool:
    try:
        job.deliver(item)
        return True
    except Exception:  # noqa: BLE001 - e.g. the event loop of a client that left is closed
        return False
