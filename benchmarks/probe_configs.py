"""Time kernels config by config: the library's candidates and a few more (needs CUDA).

    python benchmarks/probe_configs.py --shapes 8192,4096,4096,16 --rounds 3 --out probe_configs.json
    python benchmarks/probe_configs.py --kinds gemm_y,gemm_dx     # the GEMM core alone (r = 0), with cuBLAS
    python benchmarks/probe_configs.py --kinds gemm_y,gemm_dx --profile 20   # kernel time, 20 calls back to back

The GEMM core (``gemm_y`` / ``gemm_dx``: the TMA GEMM with a rank of zero, both orientations) is timed for
every row of ``configs.gemm_tma_configs`` and the tile orders and K steps of ``GEMM_ROWS``, each against cuBLAS
in the same round (``vs_cublas``). ``--configs`` keeps a subset. The first sweep here
(``results/2026-12-04-probe-gemm-configs.json``) ran while rounds rotated one fixed order: GROUP_M = 4 always
followed the slow 64x64 fallback and read 4-10% faster than the library's GROUP_M = 8; timed without it
(``...-probe-gemm-groups.json``) it was no faster. ``rounds.round_order`` now shuffles each round.

The G shrink (``G = s dy B``, its own launch before the fused dx launch) and the adapter-gradient reductions
(``dA``, ``dB`` in one launch, the path off the fused launch) read their big operand once, so their time over
its bytes is the bandwidth they reach. For every config in ``configs.shrink_configs`` / ``reduce_configs`` and
the extra rows below (more bytes in flight per program), each bound alone and checked against torch, this
prints the median time over interleaved rounds and the GB/s, and writes JSON. Which configs to offer the
autotuner follows from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import back_to_back, bench, problem, rel  # noqa: E402  (benchmarks/ is this script's directory)
from probe_spare import bound_with  # noqa: E402
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import ratio_over_rounds, time_in_rounds  # noqa: E402

from parallel_lora.kernels import configs, gemm_tma, rank_reduce, shrink  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps): the GEMM core's tile order and K step, around the library's.
GEMM_ROWS = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 16, 3, 8), (128, 256, 64, 32, 3, 8), (128, 256, 128, 8, 2, 8),
             (256, 128, 64, 16, 3, 8), (256, 128, 128, 8, 2, 8)]
# (BLOCK_M, BLOCK_K, stages, warps) and (BLOCK_F, BLOCK_M, stages, warps): deeper than the library's rows.
EXTRA_SHRINK = [(16, 256, 5, 4), (32, 128, 6, 4), (32, 256, 4, 4), (64, 64, 8, 4), (64, 128, 5, 8), (32, 64, 8, 4)]
EXTRA_REDUCE = [(128, 128, 4, 8), (128, 128, 5, 8), (128, 64, 6, 4), (64, 128, 6, 4), (256, 64, 4, 8)]


def shrink_config(bm, bk, stages, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


def reduce_config(bf, bm, stages, warps):
    return triton.Config({"BLOCK_F": bf, "BLOCK_M": bm}, num_stages=stages, num_warps=warps)


def gemm_config(bm, bn, bk, group, stages, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_stages=stages,
                         num_warps=warps)  # fmt: skip


def label(cfg: triton.Config) -> str:
    return "x".join(str(v) for v in cfg.kwargs.values()) + f"s{cfg.num_stages}w{cfg.num_warps}"


def run_shape(M, K, N, r, reps, rounds, only=None, labels=None, profile=0):
    dev, dt = "cuda", torch.bfloat16
    x, W, _, B, dy = problem(M, K, N, r)
    G = (dy.float() @ B.float()).to(dt)
    S = torch.randn(M, r, device=dev, dtype=dt)
    dA_ref, dB_ref = G.float().t() @ x.float(), dy.float().t() @ S.float()
    S0, B0, A0 = (torch.empty(*size, device=dev, dtype=dt) for size in ((M, 0), (0, N), (0, K)))
    y_ref, dx_ref = x.float() @ W.float().t(), dy.float() @ W.float()
    cases, nbytes, errs = {"cublas_y": lambda: F.linear(x, W), "cublas_dx": lambda: dy @ W}, {}, {}
    gemm_rows = [*gemm_tma.gemm_tma_configs(), *(gemm_config(*c) for c in GEMM_ROWS)]
    kinds = (
        ("gemm_y", gemm_tma, gemm_rows, lambda site: lora_gemm(x, W.t(), None, S0, B0, site=site),
         lambda y: rel(y, y_ref), None),
        ("gemm_dx", gemm_tma, gemm_rows, lambda site: lora_gemm(dy, W, None, S0, A0, site=site),
         lambda d: rel(d, dx_ref), None),
        ("shrink", shrink, [*shrink.shrink_configs(), *(shrink_config(*c) for c in EXTRA_SHRINK)],
         lambda site: shrink.lora_shrink(dy, B, 1.0, site=site), lambda g: rel(g, G), dy.numel() * 2),
        ("reduce", rank_reduce, [*rank_reduce.reduce_configs(), *(reduce_config(*c) for c in EXTRA_REDUCE)],
         lambda site: rank_reduce.lora_adapter_grads(x, G, dy, S, site=site),
         lambda out: max(rel(out[0], dA_ref), rel(out[1], dB_ref)), (x.numel() + dy.numel()) * 2),
    )  # fmt: skip
    kinds = tuple(k for k in kinds if only is None or k[0] in only)
    for kind, module, candidates, call, check, size in kinds:
        for cfg in candidates:
            if labels and label(cfg) not in labels:
                continue
            name = f"{kind}_{label(cfg)}"
            spec = dataclasses.replace(module._SPEC, configs=lambda c=cfg: [c])
            # A fresh config cache: it is keyed by the kernel and sizes, not by the config list.
            patches = [(module, "_SPEC", spec), (configs, "_BEST", {})]
            try:
                fn, out = bound_with(patches, call)
            except Exception as exc:  # past the device's shared memory: report it and go on
                print(f"  {name}: not bound ({type(exc).__name__}: {str(exc)[:100]})")
                continue
            cases[name], nbytes[name], errs[name] = fn, size, check(out)
    if not any(k[0].startswith("gemm") for k in kinds):
        del cases["cublas_y"], cases["cublas_dx"]
    for name, err in errs.items():
        if not err < 1e-2:
            print(f"  {name}: rel err {err:.3g}, dropped")
            del cases[name]
    times = time_in_rounds(cases, rounds, back_to_back(profile) if profile else lambda fn: bench(fn, reps))
    rows = []
    for name in cases:
        ms = statistics.median(times[name])
        row = {"shape": [M, K, N, r], "case": name, "ms": ms, "ms_rounds": times[name]}
        if nbytes.get(name):
            row["GB_per_s"] = nbytes[name] / ms / 1e6
        base = "cublas_y" if name.startswith("gemm_y") else "cublas_dx" if name.startswith("gemm_dx") else None
        if base:
            row["vs_cublas"] = ratio_over_rounds(times[name], times[base])
        rows.append(row)
        extra = f"{row['GB_per_s']:7.0f} GB/s" if "GB_per_s" in row else f"x{row['vs_cublas']:.3f}" if base else ""
        print(f"{M:>5} {K:>5} {N:>5} {r:>4} {name:>28} {ms * 1e3:8.1f} us {extra}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;M,K,N,r;...")
    parser.add_argument("--reps", type=int, default=30, help="ms of timed repetitions per case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all cases of a shape")
    parser.add_argument("--kinds", default="", help="comma-separated subset of gemm_y, gemm_dx, shrink, reduce")
    parser.add_argument("--configs", default="", help="comma-separated config labels to keep (e.g. 128x256x64x8s3w8)")
    parser.add_argument("--profile", type=int, default=0,
                        help="time each case by its kernels' GPU time over this many calls back to back (no L2 flush)")
    parser.add_argument("--out", default="probe_configs.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_configs.py needs a CUDA GPU")
    rows = []
    only = set(args.kinds.split(",")) if args.kinds else None
    labels = set(args.configs.split(",")) if args.configs else None
    for shape in parse_shapes(args.shapes):
        rows += run_shape(*shape, args.reps, args.rounds, only, labels, args.profile)
    write_json(args.out, {"meta": run_meta(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
