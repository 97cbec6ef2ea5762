"""Time each launch of the fused LoRA op on its own, next to the cuBLAS GEMMs it rides on (needs CUDA).

    python benchmarks/kernel_breakdown.py                 # the DESIGN section 6 shapes
    python benchmarks/kernel_breakdown.py --shapes 8192,4096,4096,16 --out breakdown.json

For each ``M, K, N, r`` (bf16) it checks every kernel against torch first, then prints medians
(``triton.testing.do_bench``) of:

- ``copy``                    a device-to-device copy of x (bytes read + written: the bandwidth ceiling)
- ``cublas_y`` / ``cublas_dx`` ``F.linear(x, W)`` and ``dy @ W``: the base layer's two GEMMs
- ``gemm_y`` / ``gemm_dx``     our GEMM with the rank-r term folded in (``_r0``: a rank of zero, the bare
                               core; ``_ptr``: the portable pointer kernel instead of the TMA one; ``_drop``:
                               dx with the "pre" dropout mask on the LoRA term)
- ``shrink_S`` / ``shrink_G``  ``S = s x A^T`` and ``G = s dy B`` (``_drop``: with the "pre" mask on x)
- ``reduce_dB`` / ``reduce_dA`` ``dB = dy^T S`` and ``dA = G^T x`` (``_drop``: with the mask on x)
- ``shrink_gemm``              S and y in one launch (S produced on the GEMM's spare SMs), with ``vs_cublas``
                               against ``cublas_y`` (``_drop``: with the "post" mask on S; the op keeps
                               "pre" on the separate launches)
- ``dx_grads``                 dx, dA and dB in one launch (the reductions on the GEMM's spare SMs), with
                               ``vs_cublas`` against ``cublas_dx`` (``_drop``: with the "pre" masks)
- ``forward`` / ``backward``   the whole op (``parallel_lora.kernels.forward`` / ``backward``; ``_separate``:
                               without the fused launches, as off the TMA path)

with the bytes each kernel must move over its time (GB/s) for the bandwidth-bound ones, and the chosen
autotune config of each kernel. Writes ``{"meta": ..., "rows": [...]}`` as JSON.

``--profile N`` also runs each row N times under ``torch.profiler`` and prints the GPU time of every kernel it
launched (us per call): what a composite row such as ``backward`` spends where.

``--rounds N`` times every kernel of a shape once per round, N rounds in turn, each led by another kernel
(``rounds.round_order``), and reports the median over rounds (each round's time is kept in ``ms_rounds``),
with ``vs_cublas``: the median over rounds of a GEMM row's time over the cuBLAS GEMM of the same orientation
and round. On these machines a kernel's time drifts by up to 10-20% within minutes (cuBLAS itself did), so
comparisons across rows of one pass can mislead; rounds put the drift on every row alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import parse_shapes, run_meta, write_json  # noqa: E402  (benchmarks/ is this script's directory)
from rounds import ratio_over_rounds, time_in_rounds  # noqa: E402

from parallel_lora import kernels  # noqa: E402
from parallel_lora.dropout import Dropout  # noqa: E402
from parallel_lora.kernels import configs, gemm, lora  # noqa: E402
from parallel_lora.kernels._interp import pad_rank  # noqa: E402
from parallel_lora.kernels.dx_grads import lora_dx_and_grads  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402
from parallel_lora.kernels.rank_reduce import lora_adapter_grads  # noqa: E402
from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402
from parallel_lora.kernels.shrink_db import MAX_DB_R_PAD, lora_shrink_db  # noqa: E402
from parallel_lora.kernels.shrink_gemm import lora_shrink_gemm  # noqa: E402

SHAPES = [(8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16), (8192, 4096, 4096, 64)]


def bench(fn, reps: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=reps, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def pointer_only(fn):
    """Run ``fn`` with the TMA path switched off (the portable pointer kernel)."""

    def run():
        saved = gemm.tma_compatible
        gemm.tma_compatible = lambda *a: False
        try:
            return fn()
        finally:
            gemm.tma_compatible = saved

    return run


def separate_launches(fn):
    """Run ``fn`` without the fused launches (S and y, dx and the adapter gradients as separate launches), with
    launch sites of its own (the op's sites remember the choice per layout)."""
    fwd_sites, bwd_sites = {}, {}

    names = ("_y_takes_fused", "_dx_takes_fused", "_FORWARD_SITES", "_BACKWARD_SITES")
    off = lambda *a: False  # noqa: E731

    def run():
        saved = [getattr(lora, name) for name in names]
        for name, value in zip(names, (off, off, fwd_sites, bwd_sites), strict=True):
            setattr(lora, name, value)
        try:
            return fn()
        finally:
            for name, value in zip(names, saved, strict=True):
                setattr(lora, name, value)

    return run


def kernel_events(fn, calls: int) -> list:
    """The GPU events (kernels, memsets) of ``calls`` runs of ``fn``, back to back, by torch.profiler (after
    one run outside it: tuning, compilation)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernel_times(fn, calls: int) -> dict[str, float]:
    """GPU time (us per call) of each kernel that ``calls`` runs of ``fn`` launch, by torch.profiler."""
    totals: dict[str, float] = {}
    for event in kernel_events(fn, calls):
        totals[event.name] = totals.get(event.name, 0.0) + event.device_time / calls
    return totals


def back_to_back(calls: int):
    """A ``time_one`` for ``rounds.time_in_rounds``: one case's kernels' GPU time per call (ms) over ``calls``
    calls back to back (torch.profiler; no L2 flush between calls, whose write-back adds ~50 us to every
    ``do_bench`` call: NOTES.md, session 15). Memsets (an allocator's, a flush's) are left out."""

    def time_one(fn) -> float:
        times = kernel_times(fn, calls)
        return sum(us for name, us in times.items() if not name.startswith("Memset")) / 1e3

    return time_one


def problem(M: int, K: int, N: int, r: int) -> tuple[torch.Tensor, ...]:
    """``(x [M, K], W [N, K], A [r, K], B [N, r], dy [M, N])``, bf16 on the GPU, seeded: the inputs every
    breakdown and probe of one shape times."""
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=dt)
    W = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    A = torch.randn(r, K, device=dev, dtype=dt) / K**0.5
    B = torch.randn(N, r, device=dev, dtype=dt) / r**0.5
    dy = torch.randn(M, N, device=dev, dtype=dt)
    return x, W, A, B, dy


def run_shape(M, K, N, r, reps, rounds=1, only=None, profile_calls=0):
    dev, dt = "cuda", torch.bfloat16
    x, W, A, B, dy = problem(M, K, N, r)
    s = 2.0
    drop = Dropout(p=0.1, seed=1234, position="pre", k_offset=0)
    S = lora_shrink(x, A.t(), s)
    G = lora_shrink(dy, B, s)
    S0 = torch.empty(M, 0, device=dev, dtype=dt)
    B0 = torch.empty(0, N, device=dev, dtype=dt)
    A0 = torch.empty(0, K, device=dev, dtype=dt)

    # Correctness first (fp32 torch references).
    y_ref = x.float() @ W.float().t() + S.float() @ B.float().t()
    dx_ref = dy.float() @ W.float() + G.float() @ A.float()
    checks = {
        "gemm_y": rel(lora_gemm(x, W.t(), None, S, B.t()), y_ref),
        "gemm_y_ptr": rel(pointer_only(lambda: lora_gemm(x, W.t(), None, S, B.t()))(), y_ref),
        "gemm_dx": rel(lora_gemm(dy, W, None, G, A), dx_ref),
        "shrink_S": rel(S, s * x.float() @ A.float().t()),
        "shrink_G": rel(G, s * dy.float() @ B.float()),
        "reduce_dB": rel(lora_adapter_grads(None, None, dy, S)[1], dy.float().t() @ S.float()),
        "reduce_dA": rel(lora_adapter_grads(x, G, None, None)[0], G.float().t() @ x.float()),
        "reduce_both_dA": rel(lora_adapter_grads(x, G, dy, S)[0], G.float().t() @ x.float()),
        "reduce_both_dB": rel(lora_adapter_grads(x, G, dy, S)[1], dy.float().t() @ S.float()),
    }
    fused = lora_dx_and_grads(dy, W, False, G, A, x, S)
    # G with dB's partials runs at the ranks the backward takes it (shrink_db.MAX_DB_R_PAD) only.
    with_db = pad_rank(r) <= MAX_DB_R_PAD
    if with_db:
        g_db, pdb, blocks = lora_shrink_db(dy, B, S, s)
        checks["shrink_db_G"] = rel(g_db, s * dy.float() @ B.float())
        sums = lora_dx_and_grads(dy, W, False, G, A, x, None, db_partials=pdb, db_parts=blocks)
        checks["dx_grads_db_sums_dB"] = rel(sums[2], dy.float().t() @ S.float())
    refs = (dx_ref, G.float().t() @ x.float(), dy.float().t() @ S.float())
    checks.update({f"dx_grads_{n}": rel(t, ref) for n, t, ref in zip(("dx", "dA", "dB"), fused, refs, strict=True)})
    y_fused, s_fused = lora_shrink_gemm(x, W, True, None, A.t(), B.t(), s)
    checks.update({"shrink_gemm_y": rel(y_fused, y_ref), "shrink_gemm_S": rel(s_fused, S)})
    for name, err in checks.items():
        if not err < 1e-2:
            raise RuntimeError(f"{name} at {M},{K},{N},{r}: rel err {err:.3g}")

    p = drop.p
    cases = {
        "copy": (lambda: x.clone(), 2 * x.numel() * 2),
        "cublas_y": (lambda: F.linear(x, W), None),
        "cublas_dx": (lambda: dy @ W, None),
        "gemm_y_r0": (lambda: lora_gemm(x, W.t(), None, S0, B0), None),
        "gemm_y": (lambda: lora_gemm(x, W.t(), None, S, B.t()), None),
        "gemm_y_ptr": (pointer_only(lambda: lora_gemm(x, W.t(), None, S, B.t())), None),
        "gemm_dx_r0": (lambda: lora_gemm(dy, W, None, S0, A0), None),
        "gemm_dx": (lambda: lora_gemm(dy, W, None, G, A), None),
        "gemm_dx_drop": (lambda: lora_gemm(dy, W, None, G, A, p=p, seed=1234, lora_drop=True), None),
        "shrink_S": (lambda: lora_shrink(x, A.t(), s), x.numel() * 2),
        "shrink_S_drop": (lambda: lora_shrink(x, A.t(), s, p=p, seed=1234, drop_pre=True), x.numel() * 2),
        "shrink_G": (lambda: lora_shrink(dy, B, s), dy.numel() * 2),
        "reduce_dB": (lambda: lora_adapter_grads(None, None, dy, S), dy.numel() * 2),
        "reduce_dA": (lambda: lora_adapter_grads(x, G, None, None), x.numel() * 2),
        "reduce_both": (lambda: lora_adapter_grads(x, G, dy, S), (x.numel() + dy.numel()) * 2),
        "reduce_both_drop": (
            lambda: lora_adapter_grads(x, G, dy, S, p=p, seed=1234, drop_x=True),
            (x.numel() + dy.numel()) * 2,
        ),
        "shrink_gemm": (lambda: lora_shrink_gemm(x, W, True, None, A.t(), B.t(), s), None),
        "shrink_gemm_drop": (
            lambda: lora_shrink_gemm(x, W, True, None, A.t(), B.t(), s, p=p, seed=1234, drop_post=True),
            None,
        ),
        "dx_grads": (lambda: lora_dx_and_grads(dy, W, False, G, A, x, S), None),
        # One adapter gradient each: what each costs the launch (its share of the spare SMs and of the tail).
        # dB reads dy, which the GEMM streams through L2 at the same time; dA reads x, which nothing else reads.
        "dx_grads_dA": (lambda: lora_dx_and_grads(dy, W, False, G, A, x, None), None),
        "dx_grads_dB": (lambda: lora_dx_and_grads(dy, W, False, G, A, None, S), None),
        "dx_grads_drop": (
            lambda: lora_dx_and_grads(dy, W, False, G, A, x, S, p=p, seed=1234, lora_drop=True),
            None,
        ),
        "forward": (lambda: kernels.forward(x, W, None, A, B, s, None), None),
        "forward_drop": (lambda: kernels.forward(x, W, None, A, B, s, drop), None),
        "forward_separate": (separate_launches(lambda: kernels.forward(x, W, None, A, B, s, None)), None),
        "backward": (lambda: kernels.backward(dy, x, W, A, B, S, s, None), None),
        "backward_drop": (lambda: kernels.backward(dy, x, W, A, B, S, s, drop), None),
        "backward_separate": (separate_launches(lambda: kernels.backward(dy, x, W, A, B, S, s, None)), None),
    }
    if with_db:  # G and dB's partials from one read of dy, then dx with dA and the sums of dB's partials
        cases["shrink_db"] = (lambda: lora_shrink_db(dy, B, S, s), dy.numel() * 2)
        cases["dx_grads_db_sums"] = (
            lambda: lora_dx_and_grads(dy, W, False, G, A, x, None, db_partials=pdb, db_parts=blocks), None
        )
    if only:
        cases = {name: case for name, case in cases.items() if name in only}
    times = time_in_rounds({name: fn for name, (fn, _) in cases.items()}, rounds, lambda fn: bench(fn, reps))
    # Again after the timed calls: a launch that left shared state (counters, a queue, flags) behind shows here.
    fused = (*lora_dx_and_grads(dy, W, False, G, A, x, S), *lora_shrink_gemm(x, W, True, None, A.t(), B.t(), s))
    for n, t, ref in zip(("dx", "dA", "dB", "y", "S"), fused, (*refs, y_ref, S), strict=True):
        if not rel(t, ref) < 1e-2:
            raise RuntimeError(f"fused {n} after the timed calls at {M},{K},{N},{r}: rel err {rel(t, ref):.3g}")
    rows = []
    for name, (_fn, nbytes) in cases.items():
        ms = statistics.median(times[name])
        row = {"shape": [M, K, N, r], "kernel": name, "ms": ms, "ms_rounds": times[name]}
        if nbytes:
            row["GB_per_s"] = nbytes / ms / 1e6
        dx_like = name.startswith(("gemm_dx", "dx_grads"))
        y_like = name.startswith(("gemm_y", "shrink_gemm"))
        base = "cublas_dx" if dx_like else "cublas_y" if y_like else None
        base = base if base in times else None
        if base:
            row["vs_cublas"] = ratio_over_rounds(times[name], times[base])
        if profile_calls:
            row["profile_us"] = kernel_times(cases[name][0], profile_calls)
        rows.append(row)
        gbs = f"{row['GB_per_s']:8.0f}" if nbytes else " " * 8
        ratio = f"x{row['vs_cublas']:.3f}" if base else ""
        print(f"{M:>5} {K:>5} {N:>5} {r:>4} {name:>16} {ms * 1e3:9.1f} us {gbs} {ratio}", flush=True)
        for kernel, us in sorted(row.get("profile_us", {}).items(), key=lambda kv: -kv[1]):
            print(f"{'':>34} {us:9.1f} us  {kernel[:80]}")
    return rows, checks


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="", help="M,K,N,r;M,K,N,r;... (default: the DESIGN shapes)")
    parser.add_argument("--reps", type=int, default=100, help="ms of timed repetitions per kernel")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over all kernels of a shape")
    parser.add_argument("--kernels", default="", help="comma-separated subset of the rows to time")
    parser.add_argument("--profile", type=int, default=0, help="profile each row over this many calls")
    parser.add_argument("--out", default="kernel_breakdown.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_breakdown.py needs a CUDA GPU")
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'kernel':>16} {'time':>12} {'GB/s':>8} {'/cuBLAS':>7}")
    rows, errs = [], {}
    for shape in shapes:
        only = set(args.kernels.split(",")) if args.kernels else None
        shape_rows, checks = run_shape(*shape, args.reps, args.rounds, only, args.profile)
        rows += shape_rows
        errs[",".join(map(str, shape))] = checks
        errs[",".join(map(str, shape)) + " configs"] = configs.tuned_summary()
    write_json(args.out, {"meta": run_meta(), "rows": rows, "checks": errs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
