"""The memory's ceiling for skipping bytes: `python -m bench.memory_skip [--json]`.

Input sparsity (kernels/input_sparse.py) skips the weight column of each dropped input: one
run of N/2 bytes for a 4-bit weight of N outputs (1-3 KiB on a 1.1B or 7B model's matmuls,
a few KiB more where weights of one input are fused). Bytes skipped give the "ideal" speedup
1 / kept. What the memory delivers is another matter: the hardware prefetchers fetch ahead
along whatever they see streamed, and a random subset of short runs can cost nearly as much
as reading every run. This bench measures that ceiling on the machine it runs on, with no
compute at all: a C reader (bench/memory_skip.c, built here with the system's C compiler)
reads a random `keep` fraction of the runs of a buffer far larger than the caches, in
ascending order as a kernel walks a weight, against reading all of them, best of several
repeats, alternated.

Each result: run bytes, kept fraction, bandwidth reading all runs, and `speedup` (all / subset
time) beside `ideal` (1 / kept) and their ratio. A kernel cannot beat `speedup` at that run
size; `bench sparsity` measures how close the real one comes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("memory_skip.c")
RUN_BYTES = (1024, 2048, 4096, 8192, 16384)
KEEP = (0.5, 0.6)


def build(out_dir: Path) -> Path:
    """Compile memory_skip.c with OpenMP; RuntimeError naming what is missing."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH: install one to run this bench")
    exe = out_dir / "memory_skip"
    cmd = [cc, "-O2", "-march=native", "-fopenmp", str(SOURCE), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr.strip()}")
    return exe


def parse(lines: str) -> list[dict]:
    rows = []
    for line in lines.splitlines():
        run, keep, gbps, subset_s, all_s, ideal = line.split()
        speedup = float(all_s) / float(subset_s)
        rows.append({"run_bytes": int(run), "kept": round(float(keep), 3),
                     "all_gb_per_s": float(gbps), "speedup": round(speedup, 3),
                     "ideal": round(float(ideal), 3),
                     "fraction_of_ideal": round(speedup / float(ideal), 3)})
    return rows


def measure(buffer_mib: int, threads: int, repeats: int, runs: tuple[int, ...],
            keep: tuple[float, ...]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        args = [str(exe), str(buffer_mib), str(threads), str(repeats),
                *map(str, runs), "--", *map(str, keep)]
        done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"memory_skip failed: {done.stderr.strip()}")
    return parse(done.stdout)


def _positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or any(v < 128 or v % 128 for v in values):
        raise argparse.ArgumentTypeError("run sizes must be multiples of 128 bytes")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError("kept fractions must lie in (0, 1]")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffer-mib", type=int, default=512, help="buffer size (far above the caches)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=_positive_ints, default=RUN_BYTES, help="run sizes, bytes")
    ap.add_argument("--keep", type=_fractions, default=KEEP, help="kept fractions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.buffer_mib < 64 or args.threads < 1 or args.repeats < 1:
        ap.error("--buffer-mib must be >= 64, --threads and --repeats >= 1")
    try:
        rows = measure(args.buffer_mib, args.threads, args.repeats, args.runs, args.keep)
    except RuntimeError as e:
        print(f"bench memory_skip: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"threads": args.threads, "buffer_mib": args.buffer_mib,
                          "results": rows}, indent=1))
        return 0
    for r in rows:
        print(f"runs of {r['run_bytes']:6d} B, keep {r['kept']:.0%}: speedup {r['speedup']:.2f}x "
              f"of ideal {r['ideal']:.2f}x ({r['fraction_of_ideal']:.0%}); all runs read at "
              f"{r['all_gb_per_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
