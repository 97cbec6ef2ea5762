"""Would the shrink run faster split over K? A probe with no new kernel (needs CUDA).

    python benchmarks/probe_split.py --shapes "8192,4096,4096,16;8192,14336,4096,16" --rounds 5 --out split.json

The shrink (``kernels/shrink.py``: ``S = x A^T``, ``G = dy B``) gives each program ``BLOCK_M`` rows and the whole
K: at M = 8192 that is 256 programs of 4 warps for 132 SMs, about two warps per scheduler, and it reads x at
2.4 TB/s (1.8 TB/s with the "pre" mask) against ~3.7 TB/s for a copy. A K split into ``s`` chunks would give
``s`` times the programs, each over ``K / s`` columns. Its main loop is the library's shrink on x viewed as
``[M * s, K / s]`` (row-major, so the view is free) against ``A^T[: K / s]``: the same bytes, ``s`` times the
programs, ``1 / s`` the loop. Timing those views (each autotuned for its own shape) says what a split could
give before the split's partial sums (``s * M * r`` fp32, written and read once) are built. ``rows_q`` (the
first quarter of the rows, unsplit) shows the fixed cost of a launch against its bytes.

Cases per shape (K of the shape's ``x``), in interleaved rounds (``rounds.round_order``): ``copy`` (x into a
buffer: the bandwidth reference), ``split_s`` and ``split_s_drop`` (the "pre" mask, p = 0.1) for s in 1, 2, 4,
8, and ``rows_q``. Prints a table (us, and TB/s of x read) and writes JSON.

The committed run (``results/2026-12-04-probe-split.json``): no split helps the unmasked shrink; the masked one
gains only at large K (8192x14336: 99.9 -> 87.2 us at s = 8). benchmarks/NOTES.md, session 15.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import bench, problem  # noqa: E402  (benchmarks/ is this script's directory)
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import time_in_rounds  # noqa: E402

from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402

SPLITS = (1, 2, 4, 8)


def run_shape(M, K, N, r, reps, rounds):
    x, _W, A, _B, _dy = problem(M, K, N, r)
    u = A.t()
    buf = torch.empty_like(x)
    cases = {"copy": lambda: buf.copy_(x)}
    for s in SPLITS:
        xs, us = x.view(M * s, K // s), u[: K // s]
        cases[f"split_{s}"] = lambda xs=xs, us=us: lora_shrink(xs, us, 2.0)
        cases[f"split_{s}_drop"] = lambda xs=xs, us=us: lora_shrink(xs, us, 2.0, p=0.1, seed=1, drop_pre=True)
    cases["rows_q"] = lambda: lora_shrink(x[: M // 4], u, 2.0)
    for case in cases.values():  # tune and compile outside the rounds
        case()
    torch.cuda.synchronize()
    times = time_in_rounds(cases, rounds, lambda fn: bench(fn, reps))
    rows = []
    for name, ms in times.items():
        med = statistics.median(ms)
        read = x.numel() * x.element_size() * (0.25 if name == "rows_q" else 1.0)
        rows.append({"shape": [M, K, N, r], "case": name, "us": med * 1e3, "us_rounds": [t * 1e3 for t in ms],
                     "TB_per_s": read / (med * 1e-3) / 1e12})  # fmt: skip
        print(f"{M}x{K} r{r}  {name:14s} {med * 1e3:8.1f} us  {rows[-1]['TB_per_s']:5.2f} TB/s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=40, help="do_bench rep (ms) per timing")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for M, K, N, r in parse_shapes(args.shapes):
        rows += run_shape(M, K, N, r, args.reps, args.rounds)
    if args.out:
        write_json(args.out, {"meta": run_meta(), "rows": rows})


if __name__ == "__main__":
    main()
