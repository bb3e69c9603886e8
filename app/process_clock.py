"""Seconds since this process started, and the `EMBER_REPORT_TIMINGS` hook of `ember generate`.

Standard library only: the llama.cpp child of `ember bench startup` uses the same clock, and
must not pay for importing Ember (or torch) to do so.

The start is the kernel's: field 22 of /proc/self/stat (clock ticks since boot, read against
CLOCK_BOOTTIME, so 1/CLK_TCK = 10 ms resolution), which counts the interpreter's own start-up
and every import. Without /proc, psutil's create_time() against the wall clock.
"""

from __future__ import annotations

import json
import os
import time

from ember.models.support.atomic import atomic_write_text

REPORT_ENV = "EMBER_REPORT_TIMINGS"


def seconds_since_start() -> float:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        import psutil

        return time.time() - psutil.Process().create_time()
    # The command name (field 2) is parenthesised and may hold spaces: split after it.
    fields = stat[stat.rindex(b")") + 2:].split()
    start_ticks = int(fields[19])  # field 22 overall
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


class TimingsReport:
    """Times since process start, written as one JSON object to the file named by
    `EMBER_REPORT_TIMINGS` (nothing happens when it is unset).

    `ember generate` marks its first generated token; `ember bench startup` reads the file.
    """

    def __init__(self, path: str):
        self.path = path
        self.times: dict[str, float] = {}

    @classmethod
    def from_env(cls) -> TimingsReport | None:
        path = os.environ.get(REPORT_ENV)
        return cls(path) if path else None

    def mark(self, name: str) -> None:
        """Record `name`_s = seconds since start, the first time it is marked."""
        self.times.setdefault(f"{name}_s", seconds_since_start())

    def write(self, **extra) -> None:
        atomic_write_text(self.path, json.dumps(self.times | extra))
