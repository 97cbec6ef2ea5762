"""Time the bandwidth-bound LoRA kernels config by config, the library's candidates and deeper pipelines (CUDA).

    python benchmarks/probe_configs.py --shapes 8192,4096,4096,16 --rounds 3 --out probe_configs.json

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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_spare import bench, bound_with, rel  # noqa: E402  (benchmarks/ is this script's directory)
from report import write_json  # noqa: E402
from rounds import round_order  # noqa: E402

from parallel_lora.kernels import configs, rank_reduce, shrink  # noqa: E402

# (BLOCK_M, BLOCK_K, stages, warps) and (BLOCK_F, BLOCK_M, stages, warps): deeper than the library's rows.
EXTRA_SHRINK = [(16, 256, 5, 4), (32, 128, 6, 4), (32, 256, 4, 4), (64, 64, 8, 4), (64, 128, 5, 8), (32, 64, 8, 4)]
EXTRA_REDUCE = [(128, 128, 4, 8), (128, 128, 5, 8), (128, 64, 6, 4), (64, 128, 6, 4), (256, 64, 4, 8)]


def shrink_config(bm, bk, stages, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


def reduce_config(bf, bm, stages, warps):
    return triton.Config({"BLOCK_F": bf, "BLOCK_M": bm}, num_stages=stages, num_warps=warps)


def label(cfg: triton.Config) -> str:
    return "x".join(str(v) for v in cfg.kwargs.values()) + f"s{cfg.num_stages}w{cfg.num_warps}"


def run_shape(M, K, N, r, reps, rounds):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=dt)
    dy = torch.randn(M, N, device=dev, dtype=dt)
    B = torch.randn(N, r, device=dev, dtype=dt) / r**0.5
    G = (dy.float() @ B.float()).to(dt)
    S = torch.randn(M, r, device=dev, dtype=dt)
    dA_ref, dB_ref = G.float().t() @ x.float(), dy.float().t() @ S.float()
    cases, nbytes, errs = {}, {}, {}
    kinds = (
        ("shrink", shrink, [*shrink.shrink_configs(), *(shrink_config(*c) for c in EXTRA_SHRINK)],
         lambda site: shrink.lora_shrink(dy, B, 1.0, site=site), lambda g: rel(g, G), dy.numel() * 2),
        ("reduce", rank_reduce, [*rank_reduce.reduce_configs(), *(reduce_config(*c) for c in EXTRA_REDUCE)],
         lambda site: rank_reduce.lora_adapter_grads(x, G, dy, S, site=site),
         lambda out: max(rel(out[0], dA_ref), rel(out[1], dB_ref)), (x.numel() + dy.numel()) * 2),
    )  # fmt: skip
    for kind, module, candidates, call, check, size in kinds:
        for cfg in candidates:
            name = f"{kind}_{label(cfg)}"
            spec = dataclasses.replace(module._SPEC, configs=lambda c=cfg: [c])
            # Fresh tuner and config caches: they are keyed by the kernel and sizes, not by the config list.
            patches = [(module, "_SPEC", spec), (configs, "_TUNED", {}), (configs, "_BEST", {})]
            try:
                fn, out = bound_with(patches, call)
            except Exception as exc:  # past the device's shared memory: report it and go on
                print(f"  {name}: not bound ({type(exc).__name__}: {str(exc)[:100]})")
                continue
            cases[name], nbytes[name], errs[name] = fn, size, check(out)
    for name, err in errs.items():
        if not err < 1e-2:
            print(f"  {name}: rel err {err:.3g}, dropped")
            del cases[name]
    times = {name: [] for name in cases}
    for rnd in range(rounds):
        for name in round_order(list(cases), rnd):
            times[name].append(bench(cases[name], reps))
    rows = []
    for name in cases:
        ms = statistics.median(times[name])
        rows.append({"shape": [M, K, N, r], "case": name, "ms": ms, "ms_rounds": times[name],
                     "GB_per_s": nbytes[name] / ms / 1e6})  # fmt: skip
        print(f"{M:>5} {K:>5} {N:>5} {r:>4} {name:>24} {ms * 1e3:8.1f} us {rows[-1]['GB_per_s']:7.0f} GB/s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;M,K,N,r;...")
    parser.add_argument("--reps", type=int, default=30, help="ms of timed repetitions per case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all cases of a shape")
    parser.add_argument("--out", default="probe_configs.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_configs.py needs a CUDA GPU")
    rows = []
    for shape in args.shapes.split(";"):
        rows += run_shape(*(int(v) for v in shape.split(",")), args.reps, args.rounds)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": "python " + " ".join(sys.argv)}  # fmt: skip
    write_json(args.out, {"meta": meta, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
