"""Long fuzz run: 10,000 mutated tiny models through open/load/forward, one JSON report.

    .venv/bin/python -m bench.fuzz_models [--cases 10000] [--out report.json] [--progress]

Run from the repository root (the mutators live in `tests/fuzz_mutators.py`, shared with the
bounded run in the test suite). Each worker is a subprocess that runs cases one after another;
the parent gives every case a deadline and a hard memory cap, and replaces a worker that blows
either, so a hang or a runaway allocation is counted instead of stopping the run.

The report: cases, outcomes (ok / rejected with an EmberError / crash / hang / memory),
the largest memory growth as a fraction of the per-case bound (`memory_bound` in
`tests/fuzz_harness.py`), per-mutator counts, and the first crashes with their case ids. A case
id replays alone: `--start ID --cases 1`.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.fuzz_harness import run_case
from tests.fuzz_mutators import build_seeds, case_for, mutate_case

MIB = 1 << 20


def _worker(conn, seeds: dict, work: str, timeout: float) -> None:
    """Runs cases sent by the parent until it sends None."""
    for path in seeds.values():  # imports and first-use caches are not the case's memory
        run_case(Path(path), timeout=timeout)
    while (case := conn.recv()) is not None:
        kind, mutator, seed = case
        try:
            path = mutate_case(Path(seeds[kind]), kind, mutator, seed, Path(work))
        except Exception as exc:  # a bug in the mutator, not in Ember: report it apart
            conn.send({"status": "mutator_error", "error": f"{type(exc).__name__}: {exc}"})
            continue
        conn.send(run_case(path, timeout=timeout).to_dict())


class Worker:
    def __init__(self, seeds: dict, root: Path, index: int, timeout: float):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        work = str(root / f"work{index}")
        self.proc = ctx.Process(target=_worker, args=(child, seeds, work, timeout), daemon=True)
        self.proc.start()
        self.ps = psutil.Process(self.proc.pid)

    def run(self, case, deadline: float, hard_cap: int) -> dict:
        """The case's outcome; a hang or a breach of the hard cap kills this worker."""
        self.conn.send(case)
        end = time.monotonic() + deadline
        while not self.conn.poll(0.05):
            try:
                rss = self.ps.memory_info().rss
            except psutil.NoSuchProcess:
                break  # died: recv below reports it
            if rss > hard_cap:
                self.kill()
                return {"status": "memory", "error": f"worker RSS {rss // MIB} MiB over the cap"}
            if time.monotonic() > end:
                self.kill()
                return {"status": "hang", "error": f"no answer after {deadline} s"}
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.proc.join()
            return {"status": "crash", "error": f"worker died, exit code {self.proc.exitcode}"}

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--start", type=int, default=0, help="first case id")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    p.add_argument("--hard-cap-mib", type=int, default=4096,
                   help="kill a worker whose RSS passes this (a runaway allocation)")
    p.add_argument("--out", type=Path, help="also write the JSON report here")
    p.add_argument("--progress", action="store_true", help="a line on stderr every 500 cases")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="ember-fuzz-"))
    (root / "seeds").mkdir()
    seeds = {k: str(v) for k, v in build_seeds(root / "seeds").items()}
    counts = collections.Counter()
    per_mutator = collections.defaultdict(collections.Counter)
    crashes, max_ratio, worst = [], 0.0, None
    t0 = time.monotonic()
    worker = Worker(seeds, root, 0, args.timeout)
    for case_id in range(args.start, args.start + args.cases):
        case = case_for(case_id)
        out = worker.run(case, args.timeout + 15, args.hard_cap_mib * MIB)
        if not worker.proc.is_alive():  # killed for a hang or memory, or died on its own
            worker = Worker(seeds, root, 0, args.timeout)
        counts[out["status"]] += 1
        per_mutator[f"{case[0]}/{case[1]}"][out["status"]] += 1
        if out.get("memory_ratio", 0) > max_ratio:
            max_ratio, worst = out["memory_ratio"], case_id
        if out["status"] not in ("ok", "rejected") and len(crashes) < 50:
            crashes.append({"case": case_id, "seed_kind": case[0], "mutator": case[1], **out})
            if args.progress:
                print(json.dumps(crashes[-1]), file=sys.stderr, flush=True)
        if args.progress and (case_id + 1 - args.start) % 500 == 0:
            print(f"{case_id + 1 - args.start} cases, {dict(counts)}", file=sys.stderr, flush=True)
    worker.close()
    report = {
        "cases": args.cases,
        "first_case": args.start,
        "ok": counts["ok"],
        "rejected": counts["rejected"],
        "crashes": counts["crash"],
        "hangs": counts["hang"],
        "over_memory_bound": counts["memory"],
        "mutator_errors": counts["mutator_error"],
        "max_memory_ratio": max_ratio,
        "max_memory_ratio_case": worst,
        "memory_bound": "64 x input bytes + 64 MiB (tests/fuzz_harness.py memory_bound)",
        "elapsed_s": round(time.monotonic() - t0, 1),
        "per_mutator": {k: dict(v) for k, v in sorted(per_mutator.items())},
        "failures": crashes,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    bad = counts["crash"] + counts["hang"] + counts["memory"] + counts["mutator_error"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
