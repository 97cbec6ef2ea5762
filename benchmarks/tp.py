"""A tensor-parallel LoRA MLP against the same pair with its adapters off, at any world size (needs CUDA and NCCL).

    torchrun --nproc-per-node 2 -m benchmarks.tp
    torchrun --nproc-per-node 8 -m benchmarks.tp --shapes "8192,4096,14336,16" --rounds 7
    python -m benchmarks.tp                     # world size 1: also the plain LoRALinear pair (the wrappers' cost)

The pair is Megatron's MLP: ``ColumnParallelLoRALinear`` (dim -> hidden, output sharded), then
``RowParallelLoRALinear`` (hidden -> dim, one all-reduce of the output); a shape is ``tokens, dim, hidden, r``.
``frozen`` is the same pair with its adapters switched off (``F.linear`` on the local shards and the same
collectives: what a frozen Megatron MLP costs), ``parallel_lora`` the pair with them. At world size 1,
``lora_linear`` is the same two layers as plain ``LoRALinear``s: the difference to ``parallel_lora`` is what the
tensor-parallel wrappers cost. The outputs are checked against the plain pair first.

A step is forward+backward (gradients of x and the adapters; ``frozen``: of x alone), issued eagerly, calls back
to back between CUDA events, every case once per round in interleaved rounds (the same order on every rank, so
the collectives stay matched); a ratio is the median over rounds of the step's time over ``frozen``'s in the same
round. Rank 0 prints a table and writes ``{"meta": ..., "rows": [...]}`` to ``benchmarks/results/tp_<gpu>x<n>.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from benchmarks.common import (
    back_to_back_ms,
    parse_shapes,
    ratio_over_rounds,
    require_cuda,
    results_path,
    run_meta,
    time_in_rounds,
    write_json,
)
from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear

SHAPES = [(8192, 4096, 14336, 16), (2048, 4096, 14336, 16)]  # tokens, dim, hidden, r
DEVICE = "cuda"  # where every rank runs (the tests run the flow on the CPU over gloo, in Triton's interpreter)


def mlp_pairs(dim: int, hidden: int, r: int, mesh: DeviceMesh) -> tuple[dict[str, nn.Sequential], nn.Sequential]:
    """``({"frozen", "parallel_lora"}, plain)``: the plain ``LoRALinear`` pair, the same full weights on every rank
    (seeded), and the parallel pairs sharded from it; at world size 1 the plain pair is timed too, as
    ``"lora_linear"``."""
    torch.manual_seed(0)
    cfg = LoRAConfig(r=r, alpha=2 * r, backend="triton")
    plain = nn.Sequential(
        LoRALinear(dim, hidden, cfg, dtype=torch.bfloat16, device=DEVICE),
        LoRALinear(hidden, dim, cfg, dtype=torch.bfloat16, device=DEVICE),
    )
    for layer in plain:
        nn.init.normal_(layer.lora_B.weight, std=0.02)  # zeros would hide wrong math
    lora = nn.Sequential(
        ColumnParallelLoRALinear.from_lora_linear(copy.deepcopy(plain[0]), mesh),
        RowParallelLoRALinear.from_lora_linear(copy.deepcopy(plain[1]), mesh),
    )
    frozen = copy.deepcopy(lora)
    for layer in frozen:
        layer.adapter_enabled = False
    pairs = {"frozen": frozen, "parallel_lora": lora}
    if mesh.size() == 1:
        pairs["lora_linear"] = plain
    return pairs, plain


def check(pairs: dict[str, nn.Sequential], x: torch.Tensor, reference: torch.Tensor) -> None:
    """The parallel LoRA pair against the plain pair's output (the all-reduce sums in another order: to
    rounding)."""
    with torch.no_grad():
        y = pairs["parallel_lora"](x)
    err = ((y.float() - reference.float()).norm() / reference.float().norm()).item()
    if not err < 2e-2:
        raise RuntimeError(f"parallel_lora disagrees with the plain LoRALinear pair: rel err {err:.3g}")


def tp_rows(shape, world_size: int, times: dict[str, list[float]]) -> list[dict]:
    """One row per pair from its per-round times (``times["<impl>/fwd"]``, ``["<impl>/step"]``, ms), each ratio
    taken to ``frozen``'s in the same round."""
    impls = [name.removesuffix("/step") for name in times if name.endswith("/step")]
    return [
        {
            "world_size": world_size,
            "shape": list(shape),
            "impl": impl,
            "step_ms": statistics.median(times[f"{impl}/step"]),
            "ratio_to_frozen": ratio_over_rounds(times[f"{impl}/step"], times["frozen/step"]),
            "fwd_ms": statistics.median(times[f"{impl}/fwd"]),
            "fwd_ratio_to_frozen": ratio_over_rounds(times[f"{impl}/fwd"], times["frozen/fwd"]),
            "step_ms_rounds": times[f"{impl}/step"],
        }  # fmt: skip
        for impl in impls
    ]


def measure(shape, mesh: DeviceMesh, time_one, rounds: int) -> list[dict]:
    """The rows of one shape: every pair's forward and step, timed in ``rounds`` interleaved rounds."""
    M, dim, hidden, r = shape
    pairs, plain = mlp_pairs(dim, hidden, r, mesh)
    x = torch.randn(M, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, dim, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        check(pairs, x, plain(x))
    cases = {}
    for name, pair in pairs.items():
        # The frozen pair's adapters are switched off, not removed: its step differentiates x alone.
        inputs = [x] if name == "frozen" else [x, *(p for p in pair.parameters() if p.requires_grad)]

        def fwd(pair=pair):
            with torch.no_grad():
                return pair(x)

        cases[f"{name}/fwd"] = fwd
        cases[f"{name}/step"] = lambda pair=pair, inputs=inputs: torch.autograd.grad(pair(x), inputs, dy)
    return tp_rows(shape, mesh.size(), time_in_rounds(cases, rounds, time_one))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m benchmarks.tp", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--shapes", default="", help="tokens,dim,hidden,r;... (default: 8192 and 2048 tokens)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape (medians)")
    parser.add_argument("--calls", type=int, default=10, help="steps back to back per pair of CUDA events")
    parser.add_argument("--batches", type=int, default=5, help="event pairs per measurement (their median)")
    parser.add_argument("--out", default="", help="JSON path, written by rank 0 (default benchmarks/results/)")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    except ValueError as e:
        parser.error(f"--shapes: {e}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    require_cuda("benchmarks.tp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    rank = dist.get_rank()
    timing = f"eager steps back to back, {args.calls} per event pair, median of {args.batches}, {args.rounds} rounds"
    prefix = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    command = " ".join([prefix, "-m", "benchmarks.tp", *(sys.argv[1:] if argv is None else argv)])
    meta = run_meta(command, timing, world_size=world, backend="nccl")
    out = args.out or results_path("tp", f"x{world}")
    data: dict = {"meta": meta, "rows": []}
    if rank == 0:
        print(f"{'world':>5} {'tokens':>6} {'dim':>5} {'hidden':>6} {'r':>3} {'impl':>14} {'fwd_ms':>8} {'step_ms':>8} "
              f"{'fwd/frozen':>10} {'step/frozen':>11}")  # fmt: skip
    for shape in shapes:
        rows = measure(shape, mesh, lambda fn: back_to_back_ms(fn, args.calls, args.batches), args.rounds)
        data["rows"] += rows
        if rank == 0:
            for row in rows:
                print(f"{world:>5} {shape[0]:>6} {shape[1]:>5} {shape[2]:>6} {shape[3]:>3} {row['impl']:>14} "
                      f"{row['fwd_ms']:8.3f} {row['step_ms']:8.3f} {row['fwd_ratio_to_frozen']:10.3f} "
                      f"{row['ratio_to_frozen']:11.3f}", flush=True)  # fmt: skip
            write_json(out, data)
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
