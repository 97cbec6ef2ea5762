"""One LoRA layer against the cuBLAS base and its peers, side by side in one run (needs CUDA).

    python -m benchmarks.layer --kernel-time            # kernel time: the floors of docs/design.md, judged
    python -m benchmarks.layer --graph                  # GPU time of CUDA-graph replays
    python -m benchmarks.layer                          # eager launches, as an uncaptured training loop runs
    python -m benchmarks.layer --kernel-time --old ../other_checkout   # these kernels against another tree's
    python -m benchmarks.layer --quick                  # one shape, dropout 0, bf16 adapters: a smoke run

For each shape ``M, K, N, r`` (bf16 x and W; by default the four shapes docs/design.md sets floors for), dropout
and adapter dtype, every implementation is checked against an fp32 reference (dropout 0), then timed:

- ``base``               ``F.linear(x, W)``: the denominator of every ratio
- ``torch_eager``        PEFT-style eager: ``F.linear(x, W) + s * (drop(x) @ A^T) @ B^T``
- ``addmm``              Unsloth-style: the rank-r product accumulated with ``addmm`` into the base output
- ``peft``               the real ``peft`` LoRA layer (when importable)
- ``parallel_lora``      ``LoRALinear`` of this tree, fused Triton backend
- ``parallel_lora_old``  with ``--old``: ``LoRALinear`` of another checkout, on the same W, A, B

Forward, and forward+backward with W frozen (``torch.autograd.grad`` of x, A, B, so accumulation into ``.grad``
is not timed; the base's backward is its dx GEMM), every case once per round, in interleaved rounds; a ratio is
the median over rounds of the time over the base's in the same round (``benchmarks.common`` says why). Also the
memory held between forward and backward beyond the output. Prints a table and writes ``{"meta": ..., "rows":
[...]}`` to ``benchmarks/results/layer_<gpu>.json``.

Timing: eager ``do_bench`` medians by default (L2 flushed before each call); ``--graph`` captures each step in a
CUDA graph and times replays back to back (the GPU time of a captured step, no host); ``--kernel-time`` sums the
GPU time of the kernels of ``--calls`` calls back to back (``torch.profiler``), then prints each case's
forward+backward by kernel (each row's ``kernels_us``) and each floor of docs/design.md beside its measurement,
met or not. Only kernel time judges the floors: its rounds
agree within a fraction of a percent, where the other two move by several percent from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

import parallel_lora
from benchmarks.common import (
    back_to_back_ms,
    kernel_us,
    module_command,
    parse_dtypes,
    parse_shapes,
    ratio_over_rounds,
    require_cuda,
    results_path,
    run_meta,
    time_in_rounds,
    write_json,
)

SHAPES = [(8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16), (8192, 4096, 4096, 64)]
# (forward, forward+backward) ratio floors in kernel time at module level (docs/design.md, "Numbers"), bf16
# adapters, dropout 0: judged on LoRALinear, what users call, not on the op's kernels alone.
FLOORS = {
    (8192, 4096, 4096, 16): (1.09, 1.15),
    (8192, 4096, 14336, 16): (1.10, 1.12),
    (8192, 14336, 4096, 16): (1.07, 1.09),
    (8192, 4096, 4096, 64): (1.12, 1.20),
}
DROPOUT_FLOOR = 0.11  # what "pre" dropout 0.1 may add to fwd+bwd over dropout 0
FP32_FLOOR = 0.03  # what fp32 adapters may add to fwd+bwd over bf16 adapters
DEVICE = "cuda"  # where every case runs (the tests run the flow on the CPU, in Triton's interpreter)
GRAPH_CALLS, GRAPH_BATCHES = 10, 10  # graph replays per pair of events, batches per median: ~100 steps


def load_tree(root: Path) -> ModuleType:
    """``root/parallel_lora`` imported a second time, as package ``parallel_lora_old``: its modules import each
    other relatively, so the two trees keep their own kernels and caches."""
    init = Path(root) / "parallel_lora" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--old {root}: expected a checkout holding parallel_lora/__init__.py")
    spec = importlib.util.spec_from_file_location(
        "parallel_lora_old", init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["parallel_lora_old"] = module
    spec.loader.exec_module(module)
    return module


def make_impls(K: int, N: int, r: int, dropout: float, adapter_dtype: torch.dtype, old: ModuleType | None = None):
    """Every implementation over the same ``W [N, K]``, ``A [r, K]``, ``B [N, r]`` (B random: zeros would hide
    wrong math): ``({name: module or function}, (W, A, B, scale))``."""
    dev, dtype = DEVICE, torch.bfloat16

    def config(package):
        return package.LoRAConfig(
            r=r, alpha=2 * r, dropout=dropout, dropout_position="pre", lora_dtype=adapter_dtype, backend="triton"
        )

    cfg = config(parallel_lora)
    ours = parallel_lora.LoRALinear(K, N, cfg, dtype=dtype, device=dev)
    nn.init.normal_(ours.lora_B.weight, std=0.02)
    W, A, B, s = ours.weight, ours.lora_A.weight, ours.lora_B.weight, cfg.scale
    drop = nn.Dropout(dropout)

    def base(x):
        return F.linear(x, W)

    def torch_eager(x):
        return F.linear(x, W) + (F.linear(F.linear(drop(x).to(A.dtype), A), B) * s).to(x.dtype)

    def addmm(x):
        y = F.linear(x, W)
        x2 = drop(x).reshape(-1, K).to(A.dtype)
        return torch.addmm(y.reshape(-1, N), (x2 @ A.t()).to(x.dtype), B.t().to(x.dtype), alpha=s).view_as(y)

    impls = {"base": base, "torch_eager": torch_eager, "addmm": addmm, "parallel_lora": ours}
    if old is not None:
        theirs = old.LoRALinear(K, N, config(old), dtype=dtype, device=dev)
        with torch.no_grad():
            for mine, other in ((W, theirs.weight), (A, theirs.lora_A.weight), (B, theirs.lora_B.weight)):
                other.copy_(mine)
        impls["parallel_lora_old"] = theirs
    with contextlib.suppress(ImportError):
        impls["peft"] = peft_layer(W, A, B, dropout, adapter_dtype)
    for impl in impls.values():
        if isinstance(impl, nn.Module):
            impl.train(dropout > 0)
    return impls, (W, A, B, s)


def peft_layer(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, dropout: float, adapter_dtype: torch.dtype):
    """PEFT's LoRA layer on ``W``, with copies of ``A`` and ``B`` in ``adapter_dtype``."""
    import peft

    r, (N, K) = A.shape[0], W.shape
    lin = nn.Linear(K, N, bias=False, device=W.device, dtype=W.dtype)
    lin.weight = W
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["0"])
    layer = peft.get_peft_model(nn.Sequential(lin), config).base_model.model[0]
    layer.lora_A["default"].weight.data = A.detach().clone()
    layer.lora_B["default"].weight.data = B.detach().clone()
    layer.to(device=W.device)
    layer.lora_A["default"].to(adapter_dtype)
    layer.lora_B["default"].to(adapter_dtype)
    return layer


def validate(impls: dict, x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float) -> dict:
    """Every implementation but the base (dropout off) against an fp32 reference: ``{name: rel. Frobenius error}``."""
    ref = F.linear(x.float(), W.float()) + s * (x.float() @ A.float().t()) @ B.float().t()
    errs = {}
    for name, f in impls.items():
        if name == "base":
            continue
        with torch.no_grad():
            y = f(x)
        errs[name] = ((y.float() - ref).norm() / ref.norm()).item()
        if not errs[name] < 2e-2:
            raise RuntimeError(f"{name} disagrees with the fp32 reference: rel err {errs[name]:.3g}")
    return errs


@contextlib.contextmanager
def old_masks_may_freeze():
    """Within: the ``--old`` tree's dropout may be captured into a CUDA graph with its capture-time mask, which a
    tree that draws its seed on the host refuses (this tree draws it on the device and has nothing to lift). For
    timing only: every replay drops the same elements, and the kernels do the same work as for any other seed."""
    tree = sys.modules.get("parallel_lora_old.functional")
    refuse = getattr(tree, "refuse_frozen_masks", None)
    if refuse is not None:
        tree.refuse_frozen_masks = lambda dropout, x: None
    try:
        yield
    finally:
        if refuse is not None:
            tree.refuse_frozen_masks = refuse


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph, after warm-up calls on a side stream (tuning, compilation): the replay runs
    the same kernels with no host work between them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with old_masks_may_freeze(), torch.cuda.graph(graph):
        fn()
    return graph.replay


def steps(name: str, f, x: torch.Tensor, dy: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """``(forward, forward+backward)`` of one implementation as calls without arguments."""
    if name == "base":
        inputs = [x]
    elif isinstance(f, nn.Module):
        inputs = [x, *(p for p in f.parameters() if p.requires_grad)]
    else:
        inputs = [x, A, B]

    def fwd():
        with torch.no_grad():
            return f(x)

    def fwdbwd():
        return torch.autograd.grad(f(x), inputs, dy)

    return fwd, fwdbwd


def held_mib(f, x: torch.Tensor) -> float:
    """MiB an implementation holds between its forward and its backward, beyond the output itself."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = f(x)
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held / 2**20


def layer_rows(shape, dropout: float, adapter_dtype: str, times: dict, held: dict, errs: dict,
               kernels: dict | None = None) -> list[dict]:  # fmt: skip
    """One row per implementation of ``held`` from its per-round times (``times["<impl>/fwd"]`` and
    ``["<impl>/fwdbwd"]``, ms), each ratio taken to ``base`` round by round; with ``kernels`` (the same keys:
    us per call by kernel name), the row's ``kernels_us``."""
    rows = []
    for name, mib in held.items():
        fwd, fwdbwd = times[f"{name}/fwd"], times[f"{name}/fwdbwd"]
        rows.append({
            "shape": list(shape), "impl": name, "dropout": dropout, "adapter_dtype": adapter_dtype,
            "fwd_ratio": ratio_over_rounds(fwd, times["base/fwd"]),
            "fwdbwd_ratio": ratio_over_rounds(fwdbwd, times["base/fwdbwd"]),
            "held_mib": mib, "fwd_ms": statistics.median(fwd), "fwdbwd_ms": statistics.median(fwdbwd),
            "rel_err": errs.get(name), "fwd_ms_rounds": fwd, "fwdbwd_ms_rounds": fwdbwd,
        })  # fmt: skip
        if kernels:
            rows[-1]["kernels_us"] = {"fwd": kernels[f"{name}/fwd"], "fwdbwd": kernels[f"{name}/fwdbwd"]}
    return rows


def measure(shape, dropout: float, adapter_dtype: torch.dtype, time_one, rounds: int, graph: bool,
            wanted: set[str] | None, old: ModuleType | None, by_kernel=None) -> list[dict]:  # fmt: skip
    """The rows of one shape, dropout and adapter dtype (``wanted``: a subset of implementations; the base, and with
    ``old`` the other tree's layer, always: an A/B run must not lose its B to the subset); ``by_kernel(fn)``, when
    given, is each case's GPU time by kernel (``timer``'s, from its last round)."""
    M, K, N, r = shape
    torch.manual_seed(0)
    impls, (W, A, B, s) = make_impls(K, N, r, dropout, adapter_dtype, old)
    always = ("base", "parallel_lora_old")
    impls = {name: f for name, f in impls.items() if name in always or not wanted or name in wanted}
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    errs = validate(impls, x, W, A, B, s) if dropout == 0 else {}
    cases = {}
    for name, f in impls.items():
        fwd, fwdbwd = steps(name, f, x, dy, A, B)
        cases[f"{name}/fwd"], cases[f"{name}/fwdbwd"] = (graphed(fwd), graphed(fwdbwd)) if graph else (fwd, fwdbwd)
    times = time_in_rounds(cases, rounds, time_one)
    kernels = {key: by_kernel(fn) for key, fn in cases.items()} if by_kernel else None
    held = {name: held_mib(f, x) for name, f in impls.items()}
    return layer_rows(shape, dropout, str(adapter_dtype).removeprefix("torch."), times, held, errs, kernels)


def floor_checks(rows: list[dict], impl: str = "parallel_lora") -> list[dict]:
    """Each floor of docs/design.md that ``rows`` can judge, as ``{"shape", "measure", "value", "floor", "met"}``:
    ``impl``'s fwd and fwd+bwd ratios (bf16 adapters, dropout 0) at the floors' shapes, and at every shape what
    "pre" dropout 0.1 and fp32 adapters add to its fwd+bwd ratio, as fractions."""
    ours = {(tuple(r["shape"]), r["dropout"], r["adapter_dtype"]): r for r in rows if r["impl"] == impl}
    checks = []

    def check(shape, measure: str, value: float, floor: float) -> None:
        checks.append({"shape": list(shape), "measure": measure, "value": value, "floor": floor, "met": value <= floor})

    for (shape, dropout, adapters), row in ours.items():
        if dropout != 0 or adapters != "bfloat16":
            continue
        if shape in FLOORS:
            check(shape, "fwd / base", row["fwd_ratio"], FLOORS[shape][0])
            check(shape, "fwd+bwd / base", row["fwdbwd_ratio"], FLOORS[shape][1])
        for key, measure, floor in (((shape, 0.1, "bfloat16"), "+ dropout 0.1", DROPOUT_FLOOR),
                                    ((shape, 0.0, "float32"), "+ fp32 adapters", FP32_FLOOR)):  # fmt: skip
            if key in ours:
                check(shape, measure, ours[key]["fwdbwd_ratio"] / row["fwdbwd_ratio"] - 1, floor)
    return checks


def new_over_old(rows: list[dict]) -> list[dict]:
    """Per variant measured with ``--old``: this tree's times over the other's, the median of same-round ratios."""
    old = {(tuple(r["shape"]), r["dropout"], r["adapter_dtype"]): r for r in rows if r["impl"] == "parallel_lora_old"}
    out = []
    for row in rows:
        theirs = old.get((tuple(row["shape"]), row["dropout"], row["adapter_dtype"]))
        if row["impl"] == "parallel_lora" and theirs is not None:
            out.append({
                "shape": row["shape"], "dropout": row["dropout"], "adapter_dtype": row["adapter_dtype"],
                "fwd": ratio_over_rounds(row["fwd_ms_rounds"], theirs["fwd_ms_rounds"]),
                "fwdbwd": ratio_over_rounds(row["fwdbwd_ms_rounds"], theirs["fwdbwd_ms_rounds"]),
            })  # fmt: skip
    return out


def print_row(row: dict) -> None:
    M, K, N, r = row["shape"]
    print(f"{M:>5} {K:>5} {N:>5} {r:>4} {row['adapter_dtype']:>8} {row['dropout']:>4} {row['impl']:>17} "
          f"{row['fwd_ms']:8.3f} {row['fwdbwd_ms']:9.3f} {row['fwd_ratio']:6.3f} {row['fwdbwd_ratio']:7.3f} "
          f"{row['held_mib']:8.2f}", flush=True)  # fmt: skip


def print_kernels(rows: list[dict], top: int = 4) -> None:
    """Each row's forward+backward GPU time by kernel: its ``top`` kernels, us per call."""
    print("\nforward+backward GPU us per call, by kernel (kernel time)")
    for row in rows:
        per = row["kernels_us"]["fwdbwd"]
        names = ", ".join(f"{name[:36]} {us:.1f}" for name, us in list(per.items())[:top])
        print(f"{','.join(map(str, row['shape'])):>20} {row['adapter_dtype']:>8} {row['dropout']:>4} "
              f"{row['impl']:>17} {sum(per.values()):9.1f}: {names}")  # fmt: skip


def print_checks(checks: list[dict]) -> None:
    print(f"\nfloors of docs/design.md, kernel time\n{'M,K,N,r':>20} {'measure':>18} {'value':>7} {'floor':>7}")
    for c in checks:
        cost = c["measure"].startswith("+")
        value, floor = (f"{100 * c['value']:+6.1f}%", f"+{100 * c['floor']:.0f}%") if cost else (
            f"{c['value']:7.3f}", f"{c['floor']:7.2f}")  # fmt: skip
        print(f"{','.join(map(str, c['shape'])):>20} {c['measure']:>18} {value:>7} {floor:>7} "
              f"{'met' if c['met'] else 'NOT met'}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.layer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--kernel-time", action="store_true", help="time the kernels (torch.profiler); judge the floors")
    mode.add_argument("--graph", action="store_true", help="time CUDA-graph replays back to back (GPU time, no host)")
    parser.add_argument("--quick", action="store_true", help="one shape, dropout 0, bf16 adapters")
    parser.add_argument("--shapes", default="", help="M,K,N,r;M,K,N,r;... (default: the floors' four shapes)")
    parser.add_argument("--dropouts", default="0.0,0.1", help="comma-separated dropout probabilities")
    parser.add_argument("--adapter-dtypes", default="bfloat16,float32", help="comma-separated adapter dtypes")
    parser.add_argument("--impls", default="", help="comma-separated implementations (base and --old's row always)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per row (medians)")
    parser.add_argument("--reps", type=int, default=40, help="eager: ms of do_bench repetitions per measurement")
    parser.add_argument("--calls", type=int, default=20, help="--kernel-time: calls back to back per measurement")
    parser.add_argument("--old", type=Path, default=None, help="another checkout: its LoRALinear as an A/B row")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/layer_<gpu>.json)")
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes) if args.shapes else SHAPES[:1] if args.quick else SHAPES
    except ValueError as e:
        parser.error(f"--shapes: {e}")
    args.dropouts = [0.0] if args.quick else [float(p) for p in args.dropouts.split(",")]
    try:
        args.adapter_dtypes = parse_dtypes("bfloat16" if args.quick else args.adapter_dtypes)
    except ValueError as e:
        parser.error(f"--adapter-dtypes: {e}")
    return args


def timer(args: argparse.Namespace) -> tuple[Callable[[Callable], float], str, Callable[[Callable], dict] | None]:
    """The function that times one case for ``args``' mode, its description for the JSON's meta, and under
    ``--kernel-time`` the lookup of a case's GPU us by kernel in its last timed round (else None)."""
    if args.kernel_time:
        last: dict[Callable, dict[str, float]] = {}

        def kernel_time(fn: Callable) -> float:
            last[fn] = kernel_us(fn, args.calls)
            return sum(last[fn].values()) / 1e3

        return kernel_time, f"kernel time (torch.profiler), {args.calls} calls back to back", last.__getitem__
    if args.graph:
        how = f"CUDA-graph replays back to back, {GRAPH_CALLS} per event pair, median of {GRAPH_BATCHES}, no L2 flush"
        return (lambda fn: back_to_back_ms(fn, GRAPH_CALLS, GRAPH_BATCHES)), how, None
    from triton.testing import do_bench

    how = f"eager launches, do_bench medians over {args.reps} ms, L2 flushed before each call"
    return (lambda fn: do_bench(fn, warmup=25, rep=args.reps, return_mode="median")), how, None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda("python -m benchmarks.layer")
    old = load_tree(args.old) if args.old else None
    time_one, timing, by_kernel = timer(args)
    meta = run_meta(module_command("benchmarks.layer"), f"{timing}, {args.rounds} interleaved rounds",
                    old=str(args.old) if args.old else None)  # fmt: skip
    out = Path(args.out) if args.out else results_path("layer")
    wanted = set(args.impls.split(",")) if args.impls else None
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'adapters':>8} {'drop':>4} {'impl':>17} "
          f"{'fwd_ms':>8} {'fwdbwd_ms':>9} {'fwd/x':>6} {'fb/x':>7} {'held_MiB':>8}")  # fmt: skip
    data: dict = {"meta": meta, "rows": []}
    for shape in args.shapes:
        for adapter_dtype in args.adapter_dtypes:
            for dropout in args.dropouts:
                rows = measure(shape, dropout, adapter_dtype, time_one, args.rounds, args.graph, wanted, old,
                               by_kernel)  # fmt: skip
                for row in rows:
                    print_row(row)
                data["rows"] += rows
                torch.cuda.empty_cache()
                write_json(out, data)  # after every variant: a run cut short keeps its rows
    if args.kernel_time:
        print_kernels(data["rows"])
        data["floors"] = floor_checks(data["rows"])
        print_checks(data["floors"])
    if old is not None:
        data["new_over_old"] = new_over_old(data["rows"])
        print("\nthis tree / --old tree, same rounds:  fwd  fwd+bwd")
        for ab in data["new_over_old"]:
            print(f"{','.join(map(str, ab['shape'])):>20} {ab['adapter_dtype']:>8} {ab['dropout']:>4} "
                  f"{ab['fwd']:6.3f} {ab['fwdbwd']:7.3f}")  # fmt: skip
    write_json(out, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
