"""How fast the GPU tier's fused block kernel (kernels/tier_blocks_triton.py) reads the file's
bytes: GB/s for one decoded token against matrices of a 1.1B and a 7B model's shapes, at the
default tile or, with --sweep, at each tile of a small grid (rows per program, values per
step, warps), so the default can be chosen on the card at hand. Random codes with sane
float16 scales (speed does not depend on the values); each tile's result is checked against
the default's. One JSON line per matrix.

    python -m bench.tier_kernel_speed [--sweep | --rows]   (a CUDA device; gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import tier_blocks_triton as fused
from ember.kernels import triton_support

# (rows, columns, type): 1.1B q/o, gate/up, down (Q6_K in some layers), the output layer;
# a 7B's gate/up
SHAPES = [(2048, 2048, Q.Q4_K), (5632, 2048, Q.Q4_K), (2048, 5632, Q.Q6_K),
          (32000, 2048, Q.Q6_K), (11008, 4096, Q.Q4_K)]
_SCALES_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # float16 fields of a block
# rows per program, values a step (1024 and 2048: a 1.1B's whole rows of 2048 in one or two
# steps, more loads in flight a program), warps
TILES = list(itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (1, 2, 4)))


def random_blocks(n: int, k: int, qtype, device) -> torch.Tensor:
    values, nbytes = fused._TYPES[int(qtype)][:2]
    raw = torch.randint(0, 256, (n * k // values, nbytes), dtype=torch.uint8, device=device)
    for at in _SCALES_AT[qtype]:
        scale = (torch.rand(raw.shape[0], device=device) * 0.01).half()
        raw[:, at:at + 2] = scale.view(torch.uint8).view(-1, 2)
    return raw.reshape(-1)


def rows_crossover(do_bench, device: str = "cuda") -> None:
    """For each shape and T rows of x (a short prompt): ms of the fused kernel (each row's
    program decodes the weights again) and of the prompt path (each tile of rows decoded once
    by the kernel into bfloat16, then one matmul), to place the switch between the two
    (kernels/tier_blocks.py uses the fused kernel up to MAX_ROWS rows)."""
    from ember.kernels.tier_blocks import _fused_tile, tier_blocks_matmul
    from ember.models.weights import QTensor

    for n, k, qtype in SHAPES:
        raw = random_blocks(n, k, qtype, device)
        part = [QTensor(raw, int(qtype), (n, k))]
        out = {}
        for t in (1, 2, 4, 8, 16, 32):
            x = torch.randn(t, k, device=device)
            fused_ms = do_bench(lambda: fused.block_matmul(x, raw, int(qtype), (n, k)),
                                warmup=5, rep=20)
            tiled_ms = do_bench(lambda: tier_blocks_matmul(x, part, torch.bfloat16, _fused_tile),
                                warmup=5, rep=20)
            out[t] = [round(fused_ms, 4), round(tiled_ms, 4)]
        print(json.dumps({"shape": [n, k, qtype.name], "rows_ms_fused_tiled": out}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time every tile of the grid too")
    ap.add_argument("--rows", action="store_true",
                    help="instead: ms at 1-32 rows of x, the fused kernel against the prompt path")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not triton_support.usable(torch.device("cuda")):
        raise SystemExit("needs a CUDA device and Triton")
    import triton.testing

    if args.rows:
        rows_crossover(triton.testing.do_bench)
        return

    default = (fused.BLOCK_N, fused.BLOCK_K, fused.NUM_WARPS)
    tiles = [default] + [t for t in TILES if t != default] if args.sweep else [default]
    for n, k, qtype in SHAPES:
        raw = random_blocks(n, k, qtype, "cuda")
        x = torch.randn(1, k, device="cuda")
        row, want = {}, None
        for tile in tiles:
            fused.BLOCK_N, fused.BLOCK_K, fused.NUM_WARPS = tile
            y = fused.block_matmul(x, raw, int(qtype), (n, k))
            want = y if want is None else want
            name = "x".join(map(str, tile[:2])) + f"w{tile[2]}"
            if not torch.allclose(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                row[name] = "differs"
                continue
            ms = triton.testing.do_bench(lambda: fused.block_matmul(x, raw, int(qtype), (n, k)),
                                         warmup=10, rep=40)
            row[name] = round(raw.numel() / ms / 1e6, 1)  # GB/s
        fused.BLOCK_N, fused.BLOCK_K, fused.NUM_WARPS = default
        timed = {t: v for t, v in row.items() if isinstance(v, float)}
        print(json.dumps({"shape": [n, k, qtype.name], "mb": round(raw.numel() / 1e6, 1),
                          "default_gbps": next(iter(row.values())),
                          "best": max(timed.items(), key=lambda kv: kv[1]) if timed else None,
                          "gbps": row}), flush=True)


if __name__ == "__main__":
    main()
