"""Where the backward's fused launch spends its tail (needs CUDA).

    python benchmarks/probe_spare.py --shapes 8192,4096,4096,16 --rounds 3 --out probe_spare.json

The fused launch (``kernels/dx_grads.py``) runs the dx GEMM on ``ceil(T / ceil(T / P))`` programs and the
adapter-gradient reductions on the rest, GEMM programs joining the reductions when their tiles are done.
Against the GEMM alone (``gemm_dx``) the launch's extra time is the part of the reductions the spare SMs did
not finish during the GEMM. This probe times, in interleaved rounds (``rounds.round_order``):

- ``cublas_dx``, ``gemm_dx``        the baselines
- ``fused``                         the library's launch as it is
- ``fused_dA`` / ``fused_dB``       one gradient only: is the tail the items' bytes?
- ``red_BMxSTAGES``                 the reductions' M tile and pipeline depth (bytes in flight per SM)
- ``items_ROWS``                    the longest M chunk of one item (pipeline refills against tail size)
- ``shrink_G``                      the G shrink (its separate launch, for scale)

The run committed as ``results/2026-12-04-probe-spare-tail.json`` also timed the shrink with x's tiles through a
TMA descriptor (a change measured and reverted: no faster than the pipelined pointer loads).

Each variant is bound at its first call (module knobs patched, the launch cache cleared) and checked against
torch before timing. Prints a table and writes JSON (``benchmarks/report.write_json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import bench, problem, rel  # noqa: E402  (benchmarks/ is this script's directory)
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import ratio_over_rounds, time_in_rounds  # noqa: E402

from parallel_lora.kernels import configs, dx_grads  # noqa: E402
from parallel_lora.kernels.configs import Site  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402
from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402

RED_VARIANTS = [(128, 6), (64, 10), (256, 3), (64, 6)]
ITEM_VARIANTS = [1024, 4096]


def bound_with(patches: list[tuple[object, str, object]], call):
    """``call(site)`` bound once with ``patches`` applied and the launch cache cleared; returns a closure that
    relaunches the bound kernel through its site (the patched knobs only matter at binding)."""
    site = Site()
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, value in patches:
        setattr(mod, name, value)
    configs._BOUND.clear()
    try:
        out = call(site)
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        configs._BOUND.clear()
    return (lambda: call(site)), out


def run_shape(M, K, N, r, reps, rounds):
    dt = torch.bfloat16
    x, W, A, B, dy = problem(M, K, N, r)
    s = 2.0
    G = (s * dy.float() @ B.float()).to(dt)
    S = (s * x.float() @ A.float().t()).to(dt)
    dx_ref = dy.float() @ W.float() + G.float() @ A.float()
    dA_ref, dB_ref = G.float().t() @ x.float(), dy.float().t() @ S.float()

    def fused(xa, sb):
        return lambda site: dx_grads.lora_dx_and_grads(dy, W, False, G, A, xa, sb, site=site)

    cases, checks = {}, {}
    fn, (dx, dA, dB) = bound_with([], fused(x, S))
    cases["fused"], checks["fused"] = fn, max(rel(dx, dx_ref), rel(dA, dA_ref), rel(dB, dB_ref))
    # The variants keep the config the library's launch was tuned to (one compile each, no retuning).
    tuned = configs._BEST[next(k for k in configs._BEST if k[0] == "dx_grads")]
    one = [(dx_grads, "_SPEC", dataclasses.replace(dx_grads._SPEC, configs=lambda: [tuned]))]
    variants = {
        "fused_dA": ([], fused(x, None)),
        "fused_dB": ([], fused(None, S)),
        **{f"red_{bm}x{st}": ([*one, (dx_grads, "red_tiles", lambda r_pad, t=(bm, st): t)], fused(x, S))
           for bm, st in RED_VARIANTS},  # fmt: skip
        **{f"items_{n}": ([*one, (dx_grads, "ITEM_ROWS", n)], fused(x, S)) for n in ITEM_VARIANTS},
    }
    for name, (patches, call) in variants.items():
        try:
            fn, (dx, dA, dB) = bound_with(patches, call)
        except Exception as exc:  # a variant past the device's shared memory: report it and go on
            print(f"  {name}: not bound ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        checks[name] = max(rel(dx, dx_ref), *(rel(t, ref) for t, ref in ((dA, dA_ref), (dB, dB_ref)) if t is not None))
        cases[name] = fn
    shrink_g, g = bound_with([], lambda site: lora_shrink(dy, B, s, site=site))
    cases["shrink_G"], checks["shrink_G"] = shrink_g, rel(g, G)
    cases["cublas_dx"] = lambda: dy @ W
    cases["gemm_dx"] = lambda: lora_gemm(dy, W, None, G, A)
    for name, err in checks.items():
        if not err < 1e-2:
            raise RuntimeError(f"{name} at {M},{K},{N},{r}: rel err {err:.3g}")
    times = time_in_rounds(cases, rounds, lambda fn: bench(fn, reps))
    rows = []
    for name in cases:
        ms = statistics.median(times[name])
        row = {"shape": [M, K, N, r], "case": name, "ms": ms, "ms_rounds": times[name], "rel_err": checks.get(name)}
        if not name.startswith(("shrink", "cublas")):
            row["vs_gemm_dx"] = ratio_over_rounds(times[name], times["gemm_dx"])
            pairs = zip(times[name], times["gemm_dx"], strict=True)
            row["over_gemm_dx_us"] = statistics.median(1e3 * (t - b) for t, b in pairs)
        rows.append(row)
        extra = f"{row['over_gemm_dx_us']:+8.1f} us" if "over_gemm_dx_us" in row else ""
        print(f"{M:>5} {K:>5} {N:>5} {r:>4} {name:>14} {ms * 1e3:9.1f} us {extra}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;M,K,N,r;...")
    parser.add_argument("--reps", type=int, default=60, help="ms of timed repetitions per case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all cases of a shape")
    parser.add_argument("--out", default="probe_spare.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_spare.py needs a CUDA GPU")
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'case':>14} {'time':>12} {'over gemm_dx':>11}")
    rows = []
    for shape in parse_shapes(args.shapes):
        rows += run_shape(*shape, args.reps, args.rounds)
    write_json(args.out, {"meta": run_meta(configs=configs.tuned_summary()), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
