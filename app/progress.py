"""Progress bars for long work (loading, `ember profile`, `ember bench`), on a terminal only.

The lower layers report progress through a plain callable `progress(fraction, stage)`: the
shape the chat app's model loading already uses (fraction in [0, 1], stage a short phrase such
as "layer 3 of 18"). Here that callable becomes one line on stderr, redrawn in place:

    loading  [#########...........]  45%  layer 8 of 18 · 2.1 %/s · 26 s left

Two ways to read `stage`: `ProgressBar` shows it as the detail of one task; `StageBars` treats
each new stage as a new task (`ember profile`'s stages: each gets its own line, finished when
the next begins). Nothing is drawn unless both stdout and stderr are terminals and the command
was not asked for --json (`progress_wanted`), and nothing before `delay` seconds: work that
ends sooner leaves no trace. `write()` prints a log line above the bar.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Callable, TextIO

FILL, EMPTY = "█", "░"
BAR_WIDTH = 20
REDRAW_S = 0.1  # at most ten redraws a second: a bar must not cost the work it reports


def progress_wanted(json_output: bool = False, stdout: TextIO | None = None,
                    stderr: TextIO | None = None) -> bool:
    """A bar belongs on an interactive terminal: not under --json, not when either stream is
    redirected (a log file, a pipe, a test's capture), not on a dumb terminal."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if json_output or os.environ.get("TERM") == "dumb":
        return False
    return _isatty(stdout) and _isatty(stderr)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar:
    """`progress(fraction, stage)` drawn as one line on `stream`.

    `total` and `unit` (e.g. 5, "runs") give the rate in the work's own unit; without them it
    is percent per second. Time left is extrapolated from the fraction done so far.
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, total: float | None = None,
                 unit: str = "", delay: float = 0.5, columns: int | None = None,
                 leave: bool = True, clock: Callable[[], float] = time.monotonic):
        """`columns`: the line's width (default: the terminal's, read at each redraw);
        `leave`: keep the finished bar on screen (else `close` erases it)."""
        self.label, self.total, self.unit, self.columns = label, total, unit, columns
        self.leave = leave
        self.stream = stream or sys.stderr
        self.delay, self._clock = delay, clock
        self._start = clock()
        self._fraction, self._stage = 0.0, ""
        self._drawn_at: float | None = None  # when the line was last drawn; None: never
        self._width = 0  # characters of the line on screen, to blank out a shorter redraw
        self._stale = False  # progress reported since the last draw (a redraw was throttled)
        self._lock = threading.Lock()  # reports may come from several threads (reading a file)

    def __call__(self, fraction: float, stage: str = "") -> None:
        with self._lock:
            self._fraction = min(1.0, max(self._fraction, float(fraction)))  # never backwards
            self._stage, self._stale = stage, True
            now = self._clock()
            if now - self._start < self.delay:
                return
            if self._drawn_at is None or now - self._drawn_at >= REDRAW_S or self._fraction >= 1:
                self._draw(now)

    def write(self, line: str) -> None:
        """Print `line` above the bar (the bar is redrawn under it)."""
        with self._lock:
            if self._drawn_at is not None:
                self.stream.write("\r" + " " * self._width + "\r")
            self.stream.write(line + "\n")
            if self._drawn_at is not None:
                self._draw(self._clock())
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line as last drawn (or erase it); nothing if it was never drawn."""
        with self._lock:
            if self._drawn_at is None:
                return
            if self.leave:
                if self._stale:  # the last report's redraw was throttled
                    self._draw(self._clock())
                self.stream.write("\n")
            else:
                self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._drawn_at = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: float, columns: int = 1000) -> str:
        """The bar as text at clock time `now`, at most `columns` wide (the stage's
        description is shortened first: the figures matter more)."""
        f = self._fraction
        filled = int(f * BAR_WIDTH)
        head = f"{self.label}  {FILL * filled}{EMPTY * (BAR_WIDTH - filled)}  {f:4.0%}"
        figures = []
        elapsed = now - self._start
        if f > 0 and elapsed > 0:
            figures.append(_rate(f * (self.total or 100) / elapsed,
                                 self.unit if self.total else "%"))
            figures.append("done" if f >= 1 else f"{_duration(elapsed * (1 - f) / f)} left")
        tail = " · ".join(figures)
        room = columns - len(head) - 2 - (len(tail) + 3 if tail else 0)
        stage = self._stage if len(self._stage) <= room else self._stage[:max(0, room - 1)] + "…"
        if room < 4:
            stage = ""
        text = " · ".join(p for p in (stage, tail) if p)
        return (f"{head}  {text}" if text else head)[:columns]

    def _draw(self, now: float) -> None:
        columns = self.columns or shutil.get_terminal_size().columns - 1  # the last would wrap
        text = self.line(now, columns)
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width, self._drawn_at, self._stale = len(text), now, False


class StageBars:
    """`progress(fraction, stage)` where each stage is a task of its own: a new stage erases
    the previous one's bar (the log lines say how each went) and starts a bar, and a clock,
    for itself. A stage written "name: detail" is task `name`, showing `detail` beside it."""

    def __init__(self, stream: TextIO | None = None, *, delay: float = 0.5,
                 columns: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream, self.delay, self.columns = stream or sys.stderr, delay, columns
        self._clock = clock
        self._bar: ProgressBar | None = None

    def __call__(self, fraction: float, stage: str) -> None:
        name, _, detail = stage.partition(": ")
        if self._bar is None or self._bar.label != name:
            self.close()
            self._bar = ProgressBar(name, self.stream, delay=self.delay, columns=self.columns,
                                    leave=False, clock=self._clock)
        self._bar(fraction, detail)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "StageBars":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoProgress:
    """What a command holds when no bar is wanted: progress is dropped, lines still print."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr

    def __call__(self, fraction: float, stage: str = "") -> None:
        pass

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(label: str, json_output: bool = False, **kwargs) -> ProgressBar | NoProgress:
    """A bar on stderr if `progress_wanted`, else a NoProgress (same verbs, draws nothing)."""
    return ProgressBar(label, **kwargs) if progress_wanted(json_output) else NoProgress()


def stage_bars(json_output: bool = False, **kwargs) -> StageBars | NoProgress:
    return StageBars(**kwargs) if progress_wanted(json_output) else NoProgress()


def _rate(per_s: float, unit: str) -> str:
    if per_s >= 1 or per_s == 0:
        return f"{per_s:.1f} {unit}/s"
    return f"{1 / per_s:.1f} s/{unit.rstrip('s') if unit != '%' else unit}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
