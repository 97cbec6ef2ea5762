"""Benchmark LoRA linears against the cuBLAS base layer, side by side in one run (needs CUDA).

    python launch/bench_lora.py                      # the DESIGN section 6 shapes
    python launch/bench_lora.py --quick              # one shape, for a smoke run
    python launch/bench_lora.py --shapes "2048,4096,4096,16;8192,4096,4096,16"
    python launch/bench_lora.py --out results.json   # where to write the JSON (default benchmarks/results/)

For each shape ``M, K, N, r`` it first validates every implementation against an fp32 reference, then
times, with ``triton.testing.do_bench`` medians:

- ``base``           ``F.linear(x, W)`` (the denominator of every ratio)
- ``torch_eager``    PEFT-style eager: ``F.linear(x, W) + s * (drop(x) @ A^T) @ B^T``
- ``addmm``          Unsloth-style: the rank-r product accumulated with ``addmm_`` into the base output
- ``peft``           the real ``peft`` LoRA layer (when importable)
- ``parallel_lora``  ours (``LoRALinear``, fused Triton backend)

forward, and forward+backward with W frozen (``torch.autograd.grad`` for x, A, B, so accumulation into
``.grad`` is not timed; the base's backward is its dx GEMM), and the memory held between forward and
backward. Prints a table and writes ``{"meta": ..., "rows": [...]}``.

``--graph`` captures each implementation's forward and its forward+backward in CUDA graphs and times the
replays: the GPU time alone, as a step captured whole would run (short sequences are host-bound otherwise).
Replays run back to back, ``GRAPH_CALLS`` per pair of CUDA events, median over ``GRAPH_BATCHES`` batches
(``rounds.back_to_back_ms``), with no L2 flush between them: ``do_bench``'s flush before every call added
~50 us of write-back to each timed call, more on some rounds than others, which pulled every ratio towards 1
and spread one row's base over 12% (runs before 2026-12-05's session 27 were timed that way; their JSON has no
``"timing"`` entry in ``meta``).
With dropout, our layer refuses capture (its mask seed is drawn on the host per call, so replays would reuse
one mask); for timing alone the bench lifts that refusal during capture (``masks_may_freeze``): every replay
then drops the same elements, and the kernels do the same work as for any other seed.

``--rounds N`` times every implementation of a row N times in turn, each round led by another one, and
reports medians over rounds; a ratio is the median over rounds of the time over the base's time of the same
round (each round's times are kept in ``fwd_ms_rounds`` / ``fwdbwd_ms_rounds``).

Each implementation is timed in a block of its own calls (its sustained speed). Sampling the implementations
call by call in turn (``benchmarks.rounds.interleaved_samples``) was tried: on the same H200 and code it put
the base 5-10% faster than its own blocks did (8192x4096->4096 fwd+bwd 0.761 against 0.839 ms) and ours
1-2% faster, so every LoRA implementation's ratio rose by 0.05-0.15 (benchmarks/NOTES.md, session 12).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import parse_shapes, write_json  # noqa: E402
from benchmarks.rounds import back_to_back_ms, ratio_over_rounds, round_order  # noqa: E402
from parallel_lora import LoRAConfig, LoRALinear  # noqa: E402

# Graph replays per pair of events, and batches per measurement (the median's): ~100 steps of 0.4-3 ms.
GRAPH_CALLS, GRAPH_BATCHES = 10, 10

SHAPES = [
    (8192, 4096, 4096, 16),
    (8192, 4096, 14336, 16),
    (8192, 14336, 4096, 16),
    (8192, 4096, 4096, 64),
    (8192, 4096, 4096, 128),
    (2048, 4096, 4096, 16),
]


def make_impls(K: int, N: int, r: int, dropout: float, adapter_dtype: torch.dtype, dtype=torch.bfloat16):
    """Every implementation as a module over the same W, A, B (B random: zeros would hide wrong math)."""
    dev = "cuda"
    cfg = LoRAConfig(r=r, alpha=2 * r, dropout=dropout, lora_dtype=adapter_dtype, backend="triton")
    ours = LoRALinear(K, N, cfg, dtype=dtype, device=dev)
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
    try:
        import peft

        lin = nn.Linear(K, N, bias=False, device=dev, dtype=dtype)
        lin.weight = W
        model = peft.get_peft_model(
            nn.Sequential(lin), peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["0"])
        )
        layer = model.base_model.model[0]
        layer.lora_A["default"].weight.data = A.detach().clone()
        layer.lora_B["default"].weight.data = B.detach().clone()
        layer.to(device=dev)
        layer.lora_A["default"].to(adapter_dtype)
        layer.lora_B["default"].to(adapter_dtype)
        impls["peft"] = layer
    except ImportError:
        pass
    for m in impls.values():
        if isinstance(m, nn.Module):
            m.train(dropout > 0)
    return impls, (A, B)


def _params(impl, A, B):
    if isinstance(impl, nn.Module):
        return [p for p in impl.parameters() if p.requires_grad]
    return [A, B]


def validate(impls, x, A, B, s):
    """Every implementation (dropout off) against an fp32 reference: relative Frobenius error."""
    ref = F.linear(x.float(), impls["parallel_lora"].weight.float()) + s * (x.float() @ A.float().t()) @ B.float().t()
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
def masks_may_freeze():
    """Within: our LoRA dropout may be captured into a CUDA graph with its capture-time mask (timing only)."""
    from parallel_lora import functional

    refuse = functional.refuse_frozen_masks
    functional.refuse_frozen_masks = lambda dropout, x: None
    try:
        yield
    finally:
        functional.refuse_frozen_masks = refuse


def graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up launches on a side stream, which tune and compile): the
    returned replay runs the same kernels with no host work between them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with masks_may_freeze(), torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_impl(name, f, x, dy, A, B, reps, graph=False):
    from triton.testing import do_bench

    params = [] if name == "base" else _params(f, A, B)
    inputs = [x, *params]

    def fwd():
        with torch.no_grad():
            return f(x)

    def fwdbwd():
        y = f(x)
        return torch.autograd.grad(y, inputs, dy)

    if graph:
        fwd, fwdbwd = graphed(fwd), graphed(fwdbwd)
        fwd_ms = back_to_back_ms(fwd, GRAPH_CALLS, GRAPH_BATCHES)
        fwdbwd_ms = back_to_back_ms(fwdbwd, GRAPH_CALLS, GRAPH_BATCHES)
    else:
        fwd_ms = do_bench(fwd, warmup=25, rep=reps, return_mode="median")
        fwdbwd_ms = do_bench(fwdbwd, warmup=25, rep=reps, return_mode="median")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = f(x)
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return fwd_ms, fwdbwd_ms, held / 2**20


def run(shapes, dropouts, adapter_dtypes, reps, impl_filter=None, save=None, rounds=1, graph=False):
    """Every row measured so far goes to ``save`` after each variant, so a run cut short keeps its rows.
    ``rounds`` times every implementation of a row that many times, in turn, each round led by another."""
    rows = []
    for M, K, N, r in shapes:
        for adapter_dtype in adapter_dtypes:
            for p in dropouts:
                torch.manual_seed(0)
                impls, (A, B) = make_impls(K, N, r, p, adapter_dtype)
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
                if p == 0:
                    errs = validate(impls, x, A, B, 2.0)
                else:
                    errs = {}
                names = [n for n in impls if not impl_filter or n in impl_filter or n == "base"]
                fwd, fwdbwd, held = ({n: [] for n in names} for _ in range(3))
                for rnd in range(rounds):  # a fixed order would favour whichever is timed first
                    for name in round_order(names, rnd):
                        f_ms, fb_ms, held_mib = time_impl(name, impls[name], x, dy, A, B, reps, graph)
                        fwd[name].append(f_ms)
                        fwdbwd[name].append(fb_ms)
                        held[name].append(held_mib)
                for name in names:
                    rows.append({
                        "shape": [M, K, N, r], "impl": name, "dropout": p, "graph": graph,
                        "adapter_dtype": str(adapter_dtype).replace("torch.", ""),
                        "fwd_ms": statistics.median(fwd[name]), "fwdbwd_ms": statistics.median(fwdbwd[name]),
                        "fwd_ratio": ratio_over_rounds(fwd[name], fwd["base"]),
                        "fwdbwd_ratio": ratio_over_rounds(fwdbwd[name], fwdbwd["base"]),
                        "held_mib": max(held[name]), "rel_err": errs.get(name),
                        "fwd_ms_rounds": fwd[name], "fwdbwd_ms_rounds": fwdbwd[name],
                    })  # fmt: skip
                    print_row(rows[-1])
                del impls, x, dy
                torch.cuda.empty_cache()
                if save is not None:
                    save(rows)
    return rows


def print_row(row):
    M, K, N, r = row["shape"]
    print(
        f"{M:>5} {K:>5} {N:>5} {r:>4} {row['adapter_dtype']:>8} {row['dropout']:>4} {row['impl']:>14} "
        f"{row['fwd_ms']:8.3f} {row['fwdbwd_ms']:9.3f} {row['fwd_ratio']:6.3f} {row['fwdbwd_ratio']:7.3f} "
        f"{row['held_mib']:8.1f}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, fewer variants")
    parser.add_argument("--shapes", default="", help="M,K,N,r tuples separated by ';' (default: DESIGN section 6)")
    parser.add_argument("--reps", type=int, default=40, help="ms of do_bench repetitions per measurement (eager)")
    parser.add_argument("--impls", default="", help="comma-separated subset of implementations")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/<date>-<gpu>.json)")
    parser.add_argument("--dropouts", default="0.0,0.1", help="comma-separated dropout probabilities")
    parser.add_argument("--adapter-dtypes", default="bfloat16,float32", help="comma-separated adapter dtypes")
    # One round on the H200 read forward ratios of unchanged code up to 0.05 off the three-round runs
    # (benchmarks/NOTES.md, session 21): the documented runs take three.
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row (medians)")
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays of each step (GPU time alone, no host)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lora.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    dropouts = [0.0] if args.quick else [float(p) for p in args.dropouts.split(",")]
    adapter_dtypes = [torch.bfloat16] if args.quick else [getattr(torch, d) for d in args.adapter_dtypes.split(",")]
    print(f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'adapters':>8} {'drop':>4} {'impl':>14} "
          f"{'fwd_ms':>8} {'fwdbwd_ms':>9} {'fwd/x':>6} {'fb/x':>7} {'held_MiB':>8}")
    impl_filter = set(args.impls.split(",")) if args.impls else None
    import triton

    meta = {
        "date": dt.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "dtype": "bfloat16",
        "command": "python " + " ".join(sys.argv),
        "timing": f"graph replays back to back, {GRAPH_CALLS} per event pair, median of {GRAPH_BATCHES}, no L2 flush"
        if args.graph else f"do_bench medians over {args.reps} ms, L2 flushed before each call",
    }
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parents[1] / "benchmarks" / "results"
        / f"{meta['date']}-{gpu.replace(' ', '_').lower()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows):
        from parallel_lora.kernels.configs import tuned_summary

        meta["tuned"] = tuned_summary()
        write_json(out, {"meta": meta, "rows": rows})

    run(shapes, dropouts, adapter_dtypes, args.reps, impl_filter, save=save, rounds=args.rounds, graph=args.graph)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
