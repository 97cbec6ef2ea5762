"""Time a tensor-parallel MLP pair with LoRA against the same pair without it, at any world size (needs CUDA).

    torchrun --nproc-per-node 2 benchmarks/bench_tp_mlp.py --out tp2.json

The pair is Megatron's: ``ColumnParallelLoRALinear`` (dim -> hidden, output sharded) then
``RowParallelLoRALinear`` (hidden -> dim, one all-reduce of the output), the DESIGN MLP shapes. The base is the
same two layers with their adapters switched off (``adapter_enabled = False``): ``F.linear`` on the local
shards and the same collectives, which is what a frozen Megatron MLP costs. Forward and forward+backward
(gradients of x and the adapters; the base's of x alone) are timed side by side
(``rounds.interleaved_samples``, the same call sequence on every rank, so the collectives stay matched).
Rank 0 prints a table and writes ``{"meta": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import write_json  # noqa: E402  (benchmarks/ is this script's directory)
from rounds import interleaved_samples, ratio_over_rounds  # noqa: E402  (benchmarks/ is this script's directory)

from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, RowParallelLoRALinear  # noqa: E402

SHAPES = [(8192, 4096, 14336, 16), (2048, 4096, 14336, 16)]  # tokens, dim, hidden, r


def mlp_pair(dim: int, hidden: int, r: int, mesh) -> nn.Sequential:
    cfg = LoRAConfig(r=r, alpha=2 * r, backend="triton")
    pair = nn.Sequential(
        ColumnParallelLoRALinear(dim, hidden, cfg, mesh, dtype=torch.bfloat16, device="cuda"),
        RowParallelLoRALinear(hidden, dim, cfg, mesh, dtype=torch.bfloat16, device="cuda"),
    )
    for layer in pair:
        nn.init.normal_(layer.lora_B.weight, std=0.02)  # zeros would hide wrong math
    return pair


def time_shape(M: int, dim: int, hidden: int, r: int, mesh, samples: int) -> list[dict]:
    """One row per case (``base``, ``lora``) of the pair at ``M`` tokens."""
    torch.manual_seed(0)  # the same adapters and inputs on every rank
    lora = mlp_pair(dim, hidden, r, mesh)
    base = copy.deepcopy(lora)
    for layer in base:
        layer.adapter_enabled = False
    x = torch.randn(M, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, dim, device="cuda", dtype=torch.bfloat16)
    cases = {"base": (base, [x]), "lora": (lora, [x, *(p for p in lora.parameters() if p.requires_grad)])}

    def fwd(model):
        def call():
            with torch.no_grad():
                return model(x)

        return call

    def fwdbwd(model, inputs):
        return lambda: torch.autograd.grad(model(x), inputs, dy)

    f = interleaved_samples({name: fwd(model) for name, (model, _) in cases.items()}, samples)
    fb = interleaved_samples({name: fwdbwd(*case) for name, case in cases.items()}, samples)
    return [
        {
            "shape": [M, dim, hidden, r], "case": name, "world_size": mesh.size(),
            "fwd_ms": statistics.median(f[name]), "fwdbwd_ms": statistics.median(fb[name]),
            "fwd_ratio": ratio_over_rounds(f[name], f["base"]),
            "fwdbwd_ratio": ratio_over_rounds(fb[name], fb["base"]),
        }  # fmt: skip
        for name in cases
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="JSON path (rank 0 writes it)")
    parser.add_argument("--samples", type=int, default=100, help="timed calls of each case per shape")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    rows = []
    if rank == 0:
        print(f"world size {world}: {'M':>5} {'dim':>5} {'hidden':>6} {'r':>4} {'case':>6} {'fwd_ms':>8} "
              f"{'fwdbwd_ms':>9} {'fwd/x':>6} {'fb/x':>6}")  # fmt: skip
    for M, dim, hidden, r in SHAPES:
        for row in time_shape(M, dim, hidden, r, mesh, args.samples):
            rows.append(row)
            if rank == 0:
                print(
                    f"world size {world}: {M:>5} {dim:>5} {hidden:>6} {r:>4} {row['case']:>6} {row['fwd_ms']:8.3f} "
                    f"{row['fwdbwd_ms']:9.3f} {row['fwd_ratio']:6.3f} {row['fwdbwd_ratio']:6.3f}",
                    flush=True,
                )
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        meta = {"date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "world_size": world,
                "backend": "nccl", "samples": args.samples, "command": " ".join(sys.argv)}  # fmt: skip
        write_json(args.out, {"meta": meta, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
