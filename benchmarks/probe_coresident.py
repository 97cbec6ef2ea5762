"""Could the adapter-gradient reductions run beside the dx GEMM on every SM instead of on its few spare ones?
A probe with the library's kernels on two streams (needs CUDA).

    python benchmarks/probe_coresident.py --shapes "8192,4096,4096,16;8192,14336,4096,16" --rounds 3 --out co.json

The backward's fused launch (``kernels/dx_grads.py``) runs the dx GEMM on ``ceil(T / ceil(T / P))`` programs and
the reductions (dA = G^T x, dB = dy^T S: a read of x and of dy) on the rest, so the reductions' bytes mostly
land after the GEMM: a tail of ~40 us at 8192x4096->4096 (benchmarks/NOTES.md, session 13). Yet the GEMM
leaves each SM's HBM bandwidth, issue slots, some registers and ~46 KB of shared memory idle (one 128x256 GEMM
program takes ~180 KB of the SM's 228). A reduction kernel whose blocks fit in what is left could run on
every SM *beside* the GEMM's programs: launched on a second stream right after the GEMM, its blocks fill the
room the GEMM leaves. This probe times, in interleaved rounds (``rounds.round_order``):

- ``cublas_dx``, ``gemm_dx``   the baselines (the library's persistent TMA GEMM, rank term folded)
- ``dx_grads``                 the library's fused launch (the reductions on the spare SMs)
- ``reduce``                   the reductions alone, with configs that fit beside the GEMM (~40 KB at r = 16)
- ``beside``                   ``gemm_dx`` on the current stream, ``reduce`` on a second one, joined

Results are checked against torch first. ``--carveout 100`` asks the driver to configure every SM's unified
L1 / shared memory as shared memory for both kernels (without it the reductions only start as GEMM blocks
finish); ``--no-flush`` times calls back to back instead of ``do_bench``'s flushed calls. Prints a table and the
kernels' spans in one call (``torch.profiler``), and writes JSON.

The committed runs (``results/2026-12-04-probe-coresident-*.json``): with the carveout the kernels overlap, but
the pair is no faster than the fused launch (4096->4096: 443.9 against 432.5 us; back to back 443.0 against
457.8) and slower at 14336->4096, where the GEMM stretches beside the reductions. benchmarks/NOTES.md, session 15.
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

from kernel_breakdown import bench, kernel_events, problem, rel  # noqa: E402  (benchmarks/ is this script's directory)
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import ratio_over_rounds, time_in_rounds  # noqa: E402

from parallel_lora.kernels import rank_reduce  # noqa: E402
from parallel_lora.kernels.configs import Site  # noqa: E402
from parallel_lora.kernels.dx_grads import lora_dx_and_grads  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402

# (BLOCK_F, BLOCK_M, stages, warps) within ~40 KB of shared memory at R_PAD = 16 (configs.reduce_smem; more at
# larger ranks), so that a block fits beside a 128x256 GEMM block (~180 KB) in an SM's 228 KB.
SMALL_REDUCE = [(64, 64, 4, 4), (64, 64, 3, 4), (128, 64, 2, 4), (64, 128, 2, 4), (128, 32, 3, 4), (32, 64, 4, 4)]


def small_reduce_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_F": bf, "BLOCK_M": bm}, num_stages=s, num_warps=w) for bf, bm, s, w in SMALL_REDUCE]


def run_shape(M, K, N, r, reps, rounds, carveout=None, flush=True):
    x, W, A, B, dy = problem(M, K, N, r)
    s = 2.0
    G = (s * dy.float() @ B.float()).to(dy.dtype)
    S = (s * x.float() @ A.float().t()).to(x.dtype)
    dx_ref = dy.float() @ W.float() + G.float() @ A.float()
    dA_ref, dB_ref = G.float().t() @ x.float(), dy.float().t() @ S.float()
    side = torch.cuda.Stream()
    gemm_site, fused_site, reduce_site = Site(), Site(), Site()

    # Bind the reduction with the small configs under a name of its own (the tuning caches key on it); its site
    # keeps the tuned kernel.
    saved = rank_reduce._SPEC
    rank_reduce._SPEC = dataclasses.replace(saved, name="reduce_beside", configs=small_reduce_configs)
    try:
        rank_reduce.lora_adapter_grads(x, G, dy, S, site=reduce_site)
    finally:
        rank_reduce._SPEC = saved

    def beside():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        dx = lora_gemm(dy, W, None, G, A, site=gemm_site)
        with torch.cuda.stream(side):
            dA, dB = rank_reduce.lora_adapter_grads(x, G, dy, S, site=reduce_site)
        main.wait_stream(side)
        return dx, dA, dB

    if carveout is not None:
        beside()  # binds the GEMM's site
        for site in (gemm_site, reduce_site):
            set_carveout(site.bound.compiled, carveout)
    cases = {
        "cublas_dx": lambda: dy @ W,
        "gemm_dx": lambda: lora_gemm(dy, W, None, G, A, site=gemm_site),
        "dx_grads": lambda: lora_dx_and_grads(dy, W, False, G, A, x, S, site=fused_site),
        "reduce": lambda: rank_reduce.lora_adapter_grads(x, G, dy, S, site=reduce_site),
        "beside": beside,
    }
    checks = {}
    for name in ("dx_grads", "beside"):
        dx, dA, dB = cases[name]()
        torch.cuda.synchronize()
        checks[name] = max(rel(dx, dx_ref), rel(dA, dA_ref), rel(dB, dB_ref))
        if not checks[name] < 1e-2:
            raise RuntimeError(f"{name} at {M},{K},{N},{r}: rel err {checks[name]:.3g}")
    cases["reduce"]()
    torch.cuda.synchronize()
    times = time_in_rounds(cases, rounds, (lambda fn: bench(fn, reps)) if flush else back_to_back)
    rows = []
    for name, ms in times.items():
        med = statistics.median(ms)
        ratio = ratio_over_rounds(ms, times["cublas_dx"])
        rows.append({"shape": [M, K, N, r], "case": name, "us": med * 1e3, "us_rounds": [t * 1e3 for t in ms],
                     "vs_cublas": ratio, "rel_err": checks.get(name)})  # fmt: skip
        print(f"{M}x{K}->{N} r{r}  {name:10s} {med * 1e3:9.1f} us  x{ratio:.3f} of cuBLAS", flush=True)
    print(f"  reduce config beside the GEMM: {reduce_site.bound.config}", flush=True)
    for name in ("dx_grads", "beside"):
        spans = kernel_spans(cases[name])
        for kernel, (start, end) in spans.items():
            print(f"  {name}: {kernel[:50]:50s} {start:8.1f} .. {end:8.1f} us", flush=True)
        rows.append({"shape": [M, K, N, r], "case": f"{name}_spans", "spans_us": spans, "carveout": carveout})
    return rows


def back_to_back(fn, calls: int = 50) -> float:
    """Milliseconds per call of ``calls`` calls issued back to back, no cache flush between them (CUDA events
    around the whole run): a training step's kernels follow one another the same way."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def set_carveout(compiled, percent: int) -> None:
    """``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` of a compiled Triton kernel: the share of the SM's
    unified L1 / shared memory to configure as shared memory when its blocks run (the driver otherwise picks
    the least that fits the kernel, which may leave no room for another kernel's blocks)."""
    import ctypes

    compiled._init_handles()
    libcuda = ctypes.CDLL("libcuda.so.1")
    err = libcuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), 9, ctypes.c_int(percent))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute(carveout) failed: CUresult {err}")


def kernel_spans(fn) -> dict[str, tuple[float, float]]:
    """Start and end (us, from the first kernel's start) of every kernel one call of ``fn`` runs (torch.profiler):
    do two streams' kernels overlap?"""
    events = kernel_events(fn, 1)
    t0 = min(e.time_range.start for e in events)
    return {e.name: (e.time_range.start - t0, e.time_range.end - t0) for e in events}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=40, help="do_bench rep (ms) per timing")
    parser.add_argument("--carveout", type=int, default=None, help="shared-memory carveout (%%) for both kernels")
    parser.add_argument("--no-flush", action="store_true", help="time calls back to back (no L2 flush between)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for M, K, N, r in parse_shapes(args.shapes):
        rows += run_shape(M, K, N, r, args.reps, args.rounds, args.carveout, not args.no_flush)
    if args.out:
        write_json(args.out, {"meta": run_meta(), "rows": rows})


if __name__ == "__main__":
    main()
