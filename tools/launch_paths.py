"""Each pass's two launch paths at each shape, in kernel time, beside the path the dispatch takes (needs CUDA).

    python -m tools.launch_paths                                     # llama-1b's projections at 2048 and 8192 tokens
    python -m tools.launch_paths --shapes "8192,4096,512,16;8192,512,4096,16"

docs/kernels.md says which launches a call makes. The forward is either the fused launch (``shrink_gemm``) or the
shrink and the GEMM apart; the dispatch picks by whether the spare programs keep pace. The backward is either the
fused launch (``dx_grads``, after G's) or the dx GEMM and ``adapter_grads`` apart; the dispatch takes the fused one
wherever TMA can read the operands. This times both paths of each pass, in kernel time (``torch.profiler``, calls
back to back, interleaved rounds, dropout 0), beside cuBLAS's GEMM of the same pass. So a rule's crossover can be
read off rather than assumed. Rows: ``{"shape", "adapter_dtype", "pass", "cublas_us", "fused_us", "separate_us",
"takes"}`` plus per-round times; ``takes`` is the dispatch's path. The JSON goes to
``benchmarks/results/paths_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    kernel_us,
    module_command,
    parse_dtypes,
    parse_shapes,
    require_cuda,
    results_path,
    run_meta,
    time_in_rounds,
    write_json,
)
from parallel_lora import kernels
from parallel_lora.kernels import dispatch

SHAPES = [(M, K, N, 16) for M in (2048, 8192) for K, N in ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048))]
PATHS = ("fused", "separate")
DEVICE = "cuda"  # where every case runs (the tests run the flow on the CPU, in Triton's interpreter)
SLOWER = 1.03  # the dispatch's path is reported as the slower one beyond this factor


@contextlib.contextmanager
def path(name: str | None) -> Iterator[None]:
    """Within: both passes take the ``name`` path (None: the dispatch's own choice); no layout's sites carry over."""
    keeps, dx_fused = dispatch.spares_keep_pace, dispatch._dx_takes_fused
    if name is not None:
        fused = name == "fused"
        dispatch.spares_keep_pace = lambda *args: fused
        dispatch._dx_takes_fused = lambda *args: fused and dx_fused(*args)
    dispatch.clear_sites()
    try:
        yield
    finally:
        dispatch.spares_keep_pace, dispatch._dx_takes_fused = keeps, dx_fused
        dispatch.clear_sites()


def takes(x, W, A, B, dy, s_lora) -> dict[str, str]:
    """The path the dispatch takes for each pass of these operands (under ``path``, the one it is held to)."""
    fwd = dispatch.forward_entry(x, W, None, A, B, None)[2] is not None
    bwd = dispatch.backward_entry(dy, x, W, A, B, s_lora, None, True, True, True)[3] is not None
    return {"fwd": PATHS[not fwd], "bwd": PATHS[not bwd]}


def measure(shape, adapter_dtype: torch.dtype, time_one: Callable, rounds: int) -> list[dict]:
    """One row per pass of ``shape``: cuBLAS's GEMM and our two paths, kernel us per call in interleaved rounds."""
    M, K, N, r = shape
    torch.manual_seed(0)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    W = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    A = (torch.randn(r, K, device=DEVICE) / K**0.5).to(adapter_dtype)
    B = (torch.randn(N, r, device=DEVICE) / r).to(adapter_dtype)
    y, s_lora = kernels.forward(x, W, None, A, B, 2.0, None)

    def on(name: str, fn: Callable) -> Callable:
        def call():
            with path(name):
                return fn()

        return call

    with path("fused"):
        fusable = {p for p, taken in takes(x, W, A, B, dy, s_lora).items() if taken == "fused"}
    with path(None):
        chosen = takes(x, W, A, B, dy, s_lora)
    passes = {"fwd": lambda: kernels.forward(x, W, None, A, B, 2.0, None)[0],
              "bwd": lambda: kernels.backward(dy, x, W, A, B, s_lora, 2.0, None)}  # fmt: skip
    cases = {"fwd/cublas": lambda: F.linear(x, W), "bwd/cublas": lambda: dy @ W}
    for p, fn in passes.items():
        for name in PATHS if p in fusable else PATHS[1:]:  # no fused launch for these operands: nothing to time
            cases[f"{p}/{name}"] = on(name, fn)
        if p in fusable:  # the two paths compute the same thing, up to the order of their fp32 sums
            fused, separate = (cases[f"{p}/{name}"]() for name in PATHS)
            for a, b in zip(fused, separate, strict=True):  # the forward's y row by row; the backward's dx, dA, dB
                err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                assert err < 1e-2, f"{shape} {p}: the fused and separate launches differ by {err:.1e} (norm-relative)"
    times = time_in_rounds(cases, rounds, time_one)
    rows = []
    for p in passes:
        row = {"shape": list(shape), "adapter_dtype": str(adapter_dtype).removeprefix("torch."), "pass": p,
               "takes": chosen[p]}  # fmt: skip
        for impl in ("cublas", *PATHS):
            got = times.get(f"{p}/{impl}")
            row[f"{impl}_us"] = statistics.median(got) if got else None
            row[f"{impl}_us_rounds"] = got
        rows.append(row)
    return rows


def slower_picks(rows: list[dict]) -> list[dict]:
    """The rows whose dispatch path is slower than the other by more than ``SLOWER`` (rows with both paths)."""
    both = [r for r in rows if r["fused_us"] is not None]
    return [r for r in both if r[f"{r['takes']}_us"] > SLOWER * r[f"{PATHS[r['takes'] == 'fused']}_us"]]


def print_row(row: dict) -> None:
    M, K, N, r = row["shape"]
    timed = [p for p in PATHS if row[f"{p}_us"] is not None]
    best = min(timed, key=lambda p: row[f"{p}_us"])
    fused = "-" if row["fused_us"] is None else f"{row['fused_us']:.1f}"
    print(f"{M:>5} {K:>5} {N:>5} {r:>4} {row['adapter_dtype']:>8} {row['pass']:>4} {row['cublas_us']:9.1f} "
          f"{fused:>9} {row['separate_us']:9.1f} {row['takes']:>9} {best:>9}", flush=True)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.launch_paths", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="", help="M,K,N,r;M,K,N,r;... (default: llama-1b's projections)")
    parser.add_argument("--adapter-dtypes", default="bfloat16,float32", help="comma-separated adapter dtypes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row (medians)")
    parser.add_argument("--calls", type=int, default=20, help="calls back to back per measurement")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/paths_<gpu>.json)")
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
        args.adapter_dtypes = parse_dtypes(args.adapter_dtypes)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda("python -m tools.launch_paths")
    timing = f"kernel time (torch.profiler), {args.calls} calls back to back, {args.rounds} interleaved rounds"
    data: dict = {"meta": run_meta(module_command("tools.launch_paths"), timing), "rows": []}
    out = Path(args.out) if args.out else results_path("paths")
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'adapters':>8} {'pass':>4} {'cublas_us':>9} {'fused_us':>9} "
          f"{'separate':>9} {'takes':>9} {'faster':>9}")  # fmt: skip
    for shape in args.shapes:
        for adapter_dtype in args.adapter_dtypes:
            rows = measure(shape, adapter_dtype, lambda fn: sum(kernel_us(fn, args.calls).values()), args.rounds)
            for row in rows:
                print_row(row)
            data["rows"] += rows
            write_json(out, data)  # after every variant: a run cut short keeps its rows
    slow = slower_picks(data["rows"])
    print(f"\nthe dispatch takes the slower path (by > {SLOWER - 1:.0%}) in {len(slow)} of {len(data['rows'])} rows")
    write_json(out, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
