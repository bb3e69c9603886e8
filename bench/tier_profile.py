"""Where a decoded token's time goes with the model on the GPU tier: one JSON line.

Two generations are profiled (torch.profiler) after a warm-up: the same prompt with 1 and
with 1 + N new tokens; their difference, divided by N, is what one decoded token costs
(the prompt's prefill cancels out), and the first, divided by the prompt's length, what a
prompt token costs ("prompt", the same fields):

    wall_ms          the host's wall time a token
    gpu_busy_ms      the device's kernel and copy time a token (the rest is the GPU waiting)
    launches         kernels launched a token; syncs and copies: the host calls that wait
    top_gpu / top_cpu  the kernels and host calls that take most of a token's time

    python -m bench.tier_profile MODEL [--gpu-budget 1GiB] [--prompt-tokens 64] [--tokens 16]
        [--device cuda]

(bench/gpu_check.sh runs it on a lent GPU; on a machine without CUDA it profiles the host
only, which is how it is tried here.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from ember.models.support.sizes import parse_size
from ember.offload.options.engine_options import EngineOptions
from ember.offload.options.sampling import SamplingParams
from ember.offload.runtime.engine import Engine

GREEDY = SamplingParams(temperature=0.0)
# host calls that wait for the device (a copy to the host ends with one)
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _profiled(engine: Engine, prompt: list[int], new: int, cuda: bool) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine.forget("default")
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        engine.generate(prompt, sampling=GREEDY, max_tokens=new, ignore_eos=True)
        wall = time.perf_counter() - t
    gpu, cpu = Counter(), Counter()
    gpu_n, cpu_n = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.name] += e.time_range.elapsed_us()
            gpu_n[e.name] += 1
        else:
            cpu[e.name] += e.self_cpu_time_total
            cpu_n[e.name] += 1
    return {"wall_us": wall * 1e6, "gpu": gpu, "gpu_n": gpu_n, "cpu": cpu, "cpu_n": cpu_n}


_NOTHING = {"wall_us": 0.0, "gpu": Counter(), "gpu_n": Counter(), "cpu": Counter(),
            "cpu_n": Counter()}


def _per_token(a: dict, b: dict, n: int, top: int = 10) -> dict:
    """What b took beyond a, per token of the n it added."""
    def diff(key: str) -> Counter:
        out = Counter(b[key])
        out.subtract(a[key])
        return out

    gpu, gpu_n, cpu, cpu_n = diff("gpu"), diff("gpu_n"), diff("cpu"), diff("cpu_n")
    kernels = sum(c for name, c in gpu_n.items() if not name.startswith("Memcpy"))
    return {
        "wall_ms": round((b["wall_us"] - a["wall_us"]) / n / 1e3, 3),
        "gpu_busy_ms": round(sum(gpu.values()) / n / 1e3, 3),
        "launches": round(kernels / n, 1),
        "syncs": round(sum(cpu_n[w] for w in _WAITS) / n, 1),
        "copies": round(sum(c for name, c in cpu_n.items() if name.startswith("cudaMemcpy")) / n, 1),
        "top_gpu": [[name[:70], round(us / n, 1), round(gpu_n[name] / n, 1)]
                    for name, us in gpu.most_common(top)],
        "top_cpu": [[name[:70], round(us / n, 1), round(cpu_n[name] / n, 1)]
                    for name, us in cpu.most_common(top)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-budget", default="1GiB")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16, help="decoded tokens profiled")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    n_ctx = max(1024, args.prompt_tokens + args.tokens + 8)
    engine = Engine.load(args.model, EngineOptions(device=args.device, n_ctx=n_ctx,
                                                   gpu_budget=parse_size(args.gpu_budget, "--gpu-budget")))
    try:
        prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_tokens)]
        engine.generate(prompt, sampling=GREEDY, max_tokens=4, ignore_eos=True)  # warm-up
        a = _profiled(engine, prompt, 1, cuda)
        b = _profiled(engine, prompt, 1 + args.tokens, cuda)
        row = {"model": args.model, "device": args.device, "gpu_budget": args.gpu_budget,
               "tokens": args.tokens, **_per_token(a, b, args.tokens),
               "prompt": {"tokens": args.prompt_tokens, **_per_token(_NOTHING, a, len(prompt))}}
        report = engine.hybrid_report()
        if report:
            row["tier_kernels"] = report.get("tier_kernels")
        print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
