"""The host cost of one LoRA call: CPU microseconds to issue a forward and a forward+backward, beside the GPU time of
the same work replayed from a CUDA graph (needs CUDA; ``--smoke`` runs the flow on the CPU).

    python -m benchmarks.host                           # the five shapes of docs/design.md, every case
    python -m benchmarks.host --shapes "2048,4096,4096,16" --rounds 5
    python -m benchmarks.host --smoke --out /tmp/host.json   # tiny shapes on the CPU, gloo: the flow, no graphs

Per shape ``M, K, N, r`` (bf16 x and W, W frozen), the cases, each in training mode:

- ``base``               ``nn.Linear`` (the baseline of ``parallel_lora`` and ``peft``)
- ``parallel_lora``      ``LoRALinear.from_linear`` of it, bf16/fp32 adapters x dropout 0/0.1 ("pre")
- ``peft``               PEFT's LoRA ``Linear`` on the same weight, bf16/fp32 adapters x dropout 0/0.1 (a reference)
- ``torch_colwise``      ``nn.Linear`` under torch's ``ColwiseParallel`` on a 1-rank mesh (NCCL; gloo on the CPU)
- ``column_parallel``    ``ColumnParallelLoRALinear`` on that mesh, the four variants
- ``torch_rowwise``      ``nn.Linear`` under torch's ``RowwiseParallel`` on that mesh
- ``row_parallel``       ``RowParallelLoRALinear`` on that mesh, the four variants

Forward: ``y = layer(x)`` with autograd recording (x requires grad), the output dropped. Forward+backward: the same,
then ``torch.autograd.grad(y, (x, A, B), dy)`` (the baselines: x alone). Host time: ``calls`` calls issued back to
back, wall clock around the issuing loop only, the GPU running behind, a sync between batches so that its queue
never fills and blocks the host (``benchmarks.common.host_ms``); the median over batches, then over interleaved
rounds. GPU time: the same call captured in a CUDA graph after eager warm-up calls (tuning runs there, never under
capture), replays back to back between CUDA events. Each LoRA case's margin is the median over rounds of its host
time minus its baseline's in the same round; the target of docs/design.md is <= +50 us forward and <= +150 us
forward+backward (``parallel_lora`` over ``base``, the TP layers over torch's). Prints a table and the margins, and
writes ``{"meta", "rows", "margins"}`` to ``benchmarks/results/host_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import socket
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from benchmarks.common import (
    back_to_back_ms,
    host_ms,
    module_command,
    parse_shapes,
    require_cuda,
    results_path,
    run_meta,
    time_in_rounds,
    write_json,
)
from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear

SHAPES = [(2048, 4096, 4096, 16), (8192, 4096, 512, 16), (8192, 512, 4096, 16), (2048, 2048, 2048, 16),
          (8192, 4096, 4096, 16)]  # fmt: skip
SMOKE_SHAPES = [(64, 64, 32, 8), (32, 32, 64, 4)]
VARIANTS = [(torch.bfloat16, 0.0), (torch.float32, 0.0), (torch.bfloat16, 0.1), (torch.float32, 0.1)]
# Each LoRA implementation and the baseline its margin is taken to; peft's margins are printed as a reference only.
BASELINES = {"parallel_lora": "base", "peft": "base", "column_parallel": "torch_colwise",
             "row_parallel": "torch_rowwise"}  # fmt: skip
JUDGED = ("parallel_lora", "column_parallel", "row_parallel")
LIMITS_US = (50.0, 150.0)  # docs/design.md: host margin over the baseline, forward and forward+backward


@dataclass
class Case:
    """One layer to time: its implementation, variant, module and the tensors its backward differentiates."""

    impl: str
    dropout: float
    adapter_dtype: torch.dtype | None
    module: nn.Module
    params: list[torch.Tensor]

    @property
    def key(self) -> str:
        dtype = "-" if self.adapter_dtype is None else str(self.adapter_dtype).removeprefix("torch.")
        return f"{self.impl}|{dtype}|{self.dropout}"


@contextlib.contextmanager
def one_rank_mesh(device: str) -> Iterator[DeviceMesh]:
    """Within: a 1-rank mesh on ``device`` (NCCL on CUDA, gloo on the CPU); a process group this sets up is torn
    down after."""
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh(device, (1,))
    finally:
        if created:
            dist.destroy_process_group()


def lora_config(r: int, dropout: float, adapter_dtype: torch.dtype, backend: str) -> LoRAConfig:
    return LoRAConfig(r=r, alpha=2 * r, dropout=dropout, lora_dtype=adapter_dtype, backend=backend)


def ours(linear: nn.Linear, config: LoRAConfig) -> LoRALinear:
    """``LoRALinear.from_linear(linear)`` (its weight shared), B drawn non-zero, training mode."""
    module = LoRALinear.from_linear(linear, config)
    nn.init.normal_(module.lora_B.weight, std=0.02)  # zeros could let a kernel skip work
    return module.train()


def trainable(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.train()


def build_cases(K: int, N: int, r: int, device: str, backend: str, mesh: DeviceMesh | None,
                impls: set[str] | None = None) -> list[Case]:  # fmt: skip
    """Every case of one shape over one bf16 ``W [N, K]`` (``impls``: a subset of implementations; the baselines
    of those always)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    linear = frozen(nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16))
    wanted = None if impls is None else impls | {BASELINES[i] for i in impls if i in BASELINES}
    cases = [Case("base", 0.0, None, linear, [])]
    for dtype, p in VARIANTS:
        module = ours(linear, lora_config(r, p, dtype, backend))
        cases.append(Case("parallel_lora", p, dtype, module, trainable(module)))
    with contextlib.suppress(ImportError):
        from benchmarks.layer import peft_layer

        for dtype, p in VARIANTS:
            A = torch.empty(r, K, device=device)
            nn.init.normal_(A, std=K**-0.5)
            module = peft_layer(linear.weight, A, 0.02 * torch.randn(N, r, device=device), p, dtype).train()
            cases.append(Case("peft", p, dtype, module, trainable(module)))
    if mesh is not None:
        for impl, style in (("torch_colwise", ColwiseParallel()), ("torch_rowwise", RowwiseParallel())):
            cases.append(Case(impl, 0.0, None, frozen(parallelize_module(copy.deepcopy(linear), mesh, style)), []))
        for impl, cls in (("column_parallel", ColumnParallelLoRALinear), ("row_parallel", RowParallelLoRALinear)):
            for dtype, p in VARIANTS:
                module = cls.from_lora_linear(ours(linear, lora_config(r, p, dtype, backend)), mesh).train()
                cases.append(Case(impl, p, dtype, module, trainable(module)))
    return [c for c in cases if wanted is None or c.impl in wanted]


def calls_of(case: Case, x: torch.Tensor, dy: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(forward, forward+backward)`` of a case as calls without arguments."""
    inputs = [x, *case.params]

    def fwd():
        return case.module(x)

    def fwdbwd():
        return torch.autograd.grad(case.module(x), inputs, dy)

    return fwd, fwdbwd


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph, after eager warm-up calls on a side stream (tuning, compilation, the
    collectives' communicator): the replay is the GPU work of a call with no host in it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def margin_over_rounds(times: list[float], base: list[float]) -> float:
    """The median over rounds of a case's time minus its baseline's time in the same round."""
    if len(times) != len(base) or not times:
        raise ValueError(f"expected one time per round on both sides, got {len(times)} and {len(base)}")
    return statistics.median(t - b for t, b in zip(times, base, strict=True))


def median_us(ms: list[float] | None) -> float | None:
    return None if ms is None else statistics.median(ms) * 1e3


def measure(shape, cases: list[Case], device: str, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """``(rows, margins)`` of one shape: every case's host times in interleaved rounds, then (on CUDA) its GPU times
    from CUDA-graph replays; a case whose capture fails keeps null GPU times and the error."""
    M, K, N, r = shape
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    calls = {}
    for case in cases:
        calls[f"{case.key}/fwd"], calls[f"{case.key}/fwdbwd"] = calls_of(case, x, dy)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    host = time_in_rounds(calls, args.rounds, lambda fn: host_ms(fn, args.calls, args.batches, sync))
    gpu: dict[str, list[float] | None] = dict.fromkeys(calls)
    errors: dict[str, str] = {}
    if device == "cuda" and not args.no_graphs:
        replays = {}
        for name, fn in calls.items():
            try:
                replays[name] = graphed(fn)
            except Exception as e:  # a case that cannot be captured keeps its host times
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
        gpu.update(time_in_rounds(replays, args.rounds, lambda fn: back_to_back_ms(fn, args.calls, args.batches)))
    rows = []
    for case in cases:
        fwd, fwdbwd = f"{case.key}/fwd", f"{case.key}/fwdbwd"
        row = {
            "shape": list(shape), "impl": case.impl, "dropout": case.dropout,
            "adapter_dtype": None if case.adapter_dtype is None else str(case.adapter_dtype).removeprefix("torch."),
            "host_fwd_us": median_us(host[fwd]), "host_fwdbwd_us": median_us(host[fwdbwd]),
            "gpu_fwd_us": median_us(gpu[fwd]), "gpu_fwdbwd_us": median_us(gpu[fwdbwd]),
            "host_fwd_us_rounds": [t * 1e3 for t in host[fwd]],
            "host_fwdbwd_us_rounds": [t * 1e3 for t in host[fwdbwd]],
        }  # fmt: skip
        if fwd in errors or fwdbwd in errors:
            row["gpu_error"] = errors.get(fwd) or errors.get(fwdbwd)
        rows.append(row)
    return rows, margins(rows)


def margins(rows: list[dict]) -> list[dict]:
    """Each LoRA row's host margin over its baseline's row of the same shape, round by round, judged against
    ``LIMITS_US`` (``parallel_lora`` and the TP layers; ``peft``'s as a reference, ``met`` None)."""
    base = {(tuple(r["shape"]), r["impl"]): r for r in rows if r["adapter_dtype"] is None}
    out = []
    for row in rows:
        ref = base.get((tuple(row["shape"]), BASELINES.get(row["impl"])))
        if ref is None:
            continue
        fwd = margin_over_rounds(row["host_fwd_us_rounds"], ref["host_fwd_us_rounds"])
        fwdbwd = margin_over_rounds(row["host_fwdbwd_us_rounds"], ref["host_fwdbwd_us_rounds"])
        judged = row["impl"] in JUDGED
        out.append({
            "shape": row["shape"], "impl": row["impl"], "baseline": ref["impl"], "dropout": row["dropout"],
            "adapter_dtype": row["adapter_dtype"], "fwd_us": fwd, "fwdbwd_us": fwdbwd,
            "limits_us": list(LIMITS_US), "met": (fwd <= LIMITS_US[0] and fwdbwd <= LIMITS_US[1]) if judged else None,
        })  # fmt: skip
    return out


def fmt(us: float | None, width: int) -> str:
    return f"{'-':>{width}}" if us is None else f"{us:{width}.1f}"


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        M, K, N, r = row["shape"]
        print(f"{M:>5} {K:>5} {N:>5} {r:>3} {row['impl']:>15} {row['adapter_dtype'] or '-':>8} {row['dropout']:>4} "
              f"{fmt(row['host_fwd_us'], 9)} {fmt(row['host_fwdbwd_us'], 11)} {fmt(row['gpu_fwd_us'], 8)} "
              f"{fmt(row['gpu_fwdbwd_us'], 10)}", flush=True)  # fmt: skip


def print_margins(checks: list[dict]) -> None:
    fwd_limit, fwdbwd_limit = LIMITS_US
    print(f"\nhost margin over the baseline, us (target <= +{fwd_limit:.0f} fwd, <= +{fwdbwd_limit:.0f} fwd+bwd)")
    print(f"{'M,K,N,r':>20} {'impl':>15} {'baseline':>13} {'adapters':>8} {'drop':>4} {'fwd':>7} {'fwd+bwd':>8}")
    for c in checks:
        verdict = "(reference)" if c["met"] is None else "met" if c["met"] else "NOT met"
        print(f"{','.join(map(str, c['shape'])):>20} {c['impl']:>15} {c['baseline']:>13} {c['adapter_dtype']:>8} "
              f"{c['dropout']:>4} {c['fwd_us']:+7.1f} {c['fwdbwd_us']:+8.1f} {verdict}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="", help="M,K,N,r;M,K,N,r;... (default: the five of docs/design.md)")
    parser.add_argument("--impls", default="", help="comma-separated implementations (their baselines always)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape (medians)")
    parser.add_argument("--calls", type=int, default=10, help="calls back to back per batch (host) / event pair")
    parser.add_argument("--batches", type=int, default=5, help="batches per measurement (their median)")
    parser.add_argument("--no-graphs", action="store_true", help="host times only (GPU columns null)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, gloo, no graphs: the flow")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/host_<gpu>.json; "
                                                  "--smoke writes only with --out)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes) if args.shapes else SMOKE_SHAPES if args.smoke else SHAPES
    except ValueError as e:
        parser.error(f"--shapes: {e}")
    args.impls = set(args.impls.split(",")) if args.impls else None
    known = {"base", "torch_colwise", "torch_rowwise", *BASELINES}
    if args.impls and not args.impls <= known:
        parser.error(f"--impls: expected some of {sorted(known)}, got {sorted(args.impls - known)}")
    if args.smoke:
        args.rounds, args.calls, args.batches, args.no_graphs = 1, 2, 1, True
    if min(args.rounds, args.calls, args.batches) < 1:
        parser.error("--rounds, --calls and --batches must be positive integers")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.smoke:
        require_cuda("python -m benchmarks.host")
    device, backend = ("cpu", "torch") if args.smoke else ("cuda", "triton")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    graphs = "" if args.no_graphs else (f"; GPU: CUDA-graph replays back to back, {args.calls} per event pair, "
                                        f"median of {args.batches}")  # fmt: skip
    timing = (f"host: {args.calls} calls back to back per batch, wall clock around the issuing loop, a sync between "
              f"batches, median of {args.batches}{graphs}; {args.rounds} interleaved rounds")  # fmt: skip
    meta = run_meta(module_command("benchmarks.host"), timing, backend=backend, mesh=f"1 rank, {device}")
    out = Path(args.out) if args.out else None if args.smoke else results_path("host")
    data: dict = {"meta": meta, "rows": [], "margins": []}
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>3} {'impl':>15} {'adapters':>8} {'drop':>4} {'host_fwd':>9} "
          f"{'host_fwdbwd':>11} {'gpu_fwd':>8} {'gpu_fwdbwd':>10}   (us)")  # fmt: skip
    with one_rank_mesh(device) as mesh:
        for shape in args.shapes:
            M, K, N, r = shape
            cases = build_cases(K, N, r, device, backend, mesh, args.impls)
            rows, checks = measure(shape, cases, device, args)
            print_rows(rows)
            data["rows"] += rows
            data["margins"] += checks
            del cases
            if device == "cuda":
                torch.cuda.empty_cache()
            if out is not None:
                write_json(out, data)  # after every shape: a run cut short keeps its rows
    print_margins(data["margins"])
    judged = [c for c in data["margins"] if c["met"] is not None]
    print(f"\n{sum(c['met'] for c in judged)} of {len(judged)} LoRA cases within the host margins")
    if out is not None:
        write_json(out, data)
        print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
