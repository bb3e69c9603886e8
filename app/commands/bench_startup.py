"""`ember bench startup`: from process start to first token, and peak memory, of a real
`ember generate` beside `python -c "import torch"` (the floor Ember cannot go under) and,
with `--against llama.cpp`, llama-cpp-python generating from the same file and prompt ids.

Every figure comes from a fresh child process, the children run one after another (never
two at once), and each is measured the same way:
- wall time: the parent's clock from just before the spawn to the child's exit;
- peak RSS: the kernel's, ru_maxrss of the child as `os.wait4` returns it;
- first token: the child's own time since its process started (`process_clock`), written to
  the file named by EMBER_REPORT_TIMINGS (`ember generate` has this hook).

Linux carries the high-water RSS of the memory a child shared with its parent until exec
into the child's ru_maxrss, so that can never be below this process's own peak: it loads
neither torch nor the model (the prompt and sizes come from a child, `startup_prompt`), and
reports its own peak RSS as `parent_rss_bytes`, the floor under every figure.

The page cache is warmed first (the file read once, then one untimed run of each command).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ember.models.support.errors import EmberError

from ..process_clock import REPORT_ENV
from ..progress import progress_bar
from .common import model_path, print_json

PROMPT_TOKENS = 16
FLOOR = "import_torch"
EMBER = "ember"
LLAMA = "llama.cpp"


def run(args) -> int:
    path = _check(args)
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    log(f"ember: tokenizing the {PROMPT_TOKENS}-token prompt and sizing the KV cache…")
    model = _prepare(path, args.ctx_size)
    commands = _commands(path, model, args)
    warm_s = _read_file(path)
    log(f"ember: page cache warmed ({model['file_bytes'] / 2**20:,.1f} MiB read in "
        f"{warm_s:.2f} s); one untimed run of each command")
    for cmd in commands.values():
        _measure(cmd)
    runs = {name: [] for name in commands}
    total = args.runs * len(commands)
    with progress_bar("bench startup", args.json, total=total, unit="runs") as bar:
        for i in range(args.runs):
            for name, cmd in commands.items():
                time.sleep(0.3)  # let the previous child's threads and writes settle
                runs[name].append(_measure(cmd))
                if not args.json:
                    bar.write(f"ember: run {i + 1}/{args.runs} {name}: "
                              f"{_describe(runs[name][-1])}")
                bar(sum(map(len, runs.values())) / total, f"run {i + 1} of {args.runs}")
    report = _report(path, model, commands, runs, args)
    report["page_cache"] = ("warm: the file read once, then one untimed run of each command "
                            "before the timed runs")
    print_json(report)
    return 0


def _check(args) -> Path:
    if args.runs < 1:
        raise EmberError(f"--runs must be at least 1, got {args.runs}")
    if args.max_tokens < 1:
        raise EmberError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.threads < 1:
        raise EmberError(f"--threads must be at least 1, got {args.threads}")
    if args.ctx_size < PROMPT_TOKENS + args.max_tokens:
        raise EmberError(f"--ctx-size {args.ctx_size} cannot hold the {PROMPT_TOKENS}-token "
                         f"prompt and {args.max_tokens} generated tokens")
    path = Path(model_path(args))
    if not path.is_file():
        raise EmberError(f"no model file at {path}")
    if args.against == LLAMA:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise EmberError("--against llama.cpp needs the llama.cpp baseline: pip install -e "
                             "'.[baseline]' (README: build flags for these CPUs)")
    return path


def _prepare(path: Path, ctx_size: int) -> dict:
    """The prompt, its ids, the file's size and the KV plan, from a child process."""
    res = subprocess.run([sys.executable, "-m", "ember.app.commands.startup_prompt", str(path),
                          str(PROMPT_TOKENS), str(ctx_size)], capture_output=True, text=True)
    if res.returncode != 0:
        raise EmberError(f"cannot prepare {path}: {_last_line(res.stderr)}")
    return json.loads(res.stdout)


def _commands(path: Path, model: dict, args) -> dict[str, list[str]]:
    py = sys.executable
    commands = {
        FLOOR: [py, "-c", "import torch"],
        EMBER: [py, "-m", "ember.app.cli", "generate", model["prompt"], "--model", str(path),
                "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
                "--ctx-size", str(model["n_ctx"]), "--temperature", "0", "--ignore-eos",
                "--device", "cpu", "--json"],
    }
    if args.against == LLAMA:
        commands[LLAMA] = [py, "-m", "ember.app.baseline_startup", str(path),
                           "--ctx-size", str(model["n_ctx"]), "--threads", str(args.threads),
                           "--max-tokens", str(args.max_tokens),
                           "--ids", ",".join(map(str, model["prompt_ids"]))]
    return commands


def _read_file(path: Path) -> float:
    """Read the whole file once (into one small reused buffer), so it is in the page cache."""
    t = time.perf_counter()
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def _measure(cmd: list[str]) -> dict:
    """Run `cmd` to completion: wall time, the kernel's peak RSS, its timings report and its
    standard output."""
    # The child's output goes to anonymous temporary files (no pipes to drain while waiting
    # for it with wait4, which is what gives its own peak RSS).
    with tempfile.TemporaryDirectory(prefix="ember-startup-") as tmp, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        report_path = os.path.join(tmp, "timings.json")
        env = os.environ | {REPORT_ENV: report_path}
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        stdout = out.read().decode(errors="replace")
        if proc.returncode != 0:
            err.seek(0)
            stderr = err.read().decode(errors="replace")
            raise EmberError(f"`{_short(cmd)}` failed (exit {proc.returncode}): "
                             f"{_last_line(stderr)}")
        timings = json.loads(Path(report_path).read_text()) if os.path.exists(report_path) else {}
    return {"wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
            "timings": timings, "stdout": stdout}


def _report(path: Path, model: dict, commands: dict, runs: dict, args) -> dict:
    file_kv = model["file_bytes"] + model["kv_cache_bytes"]
    report = {
        "model": str(path), "name": model["name"], "architecture": model["architecture"],
        "file_bytes": model["file_bytes"], "kv_cache_bytes": model["kv_cache_bytes"],
        "file_plus_kv_bytes": file_kv, "ctx_size": model["n_ctx"], "threads": args.threads,
        "max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS,
        "prompt": model["prompt"], "prompt_ids": model["prompt_ids"], "runs": args.runs,
        "cpu": cpu_info(),
        "parent_rss_bytes": _own_peak_rss(),
        "commands": commands,
    }
    for name, measured in runs.items():
        entry = {"wall_s": _spread([m["wall_s"] for m in measured]),
                 "peak_rss_bytes": _spread([m["peak_rss_bytes"] for m in measured])}
        if name != FLOOR:
            entry["first_token_s"] = _spread([_first_token(name, m) for m in measured])
            entry["generated_tokens"] = measured[0]["timings"].get("generated_tokens")
            entry["rss_over_file_plus_kv"] = entry["peak_rss_bytes"]["median"] / file_kv
        report[name] = entry
    ember_ids = json.loads(runs[EMBER][0]["stdout"])["prompt_token_ids"]
    report[EMBER]["prompt_ids_match"] = ember_ids == model["prompt_ids"]
    report[EMBER]["first_token_minus_import_torch_s"] = (
        report[EMBER]["first_token_s"]["median"] - report[FLOOR]["wall_s"]["median"])
    if LLAMA in runs:
        report["ratio_ember_over_llama_cpp"] = {
            key: report[EMBER][key]["median"] / report[LLAMA][key]["median"]
            for key in ("peak_rss_bytes", "first_token_s", "wall_s")}
    return report


def _own_peak_rss() -> int:
    """This process's own high-water RSS (VmHWM): what its children's ru_maxrss starts from.
    Not getrusage(RUSAGE_SELF), which also carries the peak of whatever process spawned us."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _first_token(name: str, measured: dict) -> float:
    value = measured["timings"].get("first_token_s")
    if value is None:
        raise EmberError(f"{name} wrote no first-token time to {REPORT_ENV}")
    return value


def cpu_info() -> dict:
    """The CPU's model name and the features that pick Ember's kernels, from /proc/cpuinfo."""
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        name = platform.processor() or name
    return {"model": name, "logical_cpus": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_tile" in flags}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _describe(m: dict) -> str:
    first = m["timings"].get("first_token_s")
    first = "" if first is None else f", first token {first:.2f} s"
    return f"peak RSS {m['peak_rss_bytes'] / 2**20:,.0f} MiB, wall {m['wall_s']:.2f} s{first}"


def _short(cmd: list[str]) -> str:
    return " ".join(Path(cmd[0]).name if i == 0 else a for i, a in enumerate(cmd[:5])) + " …"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"
