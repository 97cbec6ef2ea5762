"""Time the tensor-parallel layers at world size 1 (NCCL) against the plain ``LoRALinear`` (needs CUDA).

    python benchmarks/bench_tp.py --out tp1.json

At world size 1 the parallel layers run the same fused kernels on "shards" that are the whole tensors, plus
their DTensor bookkeeping and the (single-rank) NCCL collectives; the difference to ``LoRALinear`` is what
the wrapper costs. Forward and forward+backward (grads of x and the adapters) medians from ``do_bench``,
after checking that the three layers agree, and the host time to enqueue one fwd+bwd (``fb_host_ms``: when it
exceeds the GPU time, the GPU waits for Python). ``--profile`` adds each layer's top ops by CUDA and by CPU
time. Prints a table and writes ``{"meta": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_op import host_ms  # noqa: E402  (benchmarks/ is this script's directory)
from report import write_json  # noqa: E402  (benchmarks/ is this script's directory)

from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear  # noqa: E402

SHAPES = [(8192, 4096, 4096, 16), (2048, 4096, 4096, 16)]


def profile_table(name: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"--- {name}, 5 x fwd+bwd")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    print(averages.table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=50))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="JSON path")
    parser.add_argument("--reps", type=int, default=100, help="ms of timed repetitions per measurement")
    parser.add_argument("--profile", action="store_true", help="print each layer's top CUDA/CPU ops of fwd+bwd")
    args = parser.parse_args()
    from triton.testing import do_bench

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    rows = []
    print(
        f"{'M':>5} {'K':>5} {'N':>5} {'r':>4} {'layer':>26} {'fwd_ms':>8} {'fwdbwd_ms':>9} {'fwd/x':>6} {'fb/x':>6} "
        f"{'fb_host_ms':>10}"
    )
    for M, K, N, r in SHAPES:
        torch.manual_seed(0)
        cfg = LoRAConfig(r=r, alpha=2 * r, backend="triton")
        plain = LoRALinear(K, N, cfg, dtype=torch.bfloat16, device="cuda")
        nn.init.normal_(plain.lora_B.weight, std=0.02)
        layers = {
            "LoRALinear": plain,
            "ColumnParallelLoRALinear": ColumnParallelLoRALinear.from_lora_linear(copy.deepcopy(plain), mesh),
            "RowParallelLoRALinear": RowParallelLoRALinear.from_lora_linear(copy.deepcopy(plain), mesh),
        }
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want = plain(x)
            for name, layer in layers.items():
                if not torch.equal(layer(x), want):
                    raise RuntimeError(f"{name} disagrees with LoRALinear at world size 1")
        base = None
        for name, layer in layers.items():
            inputs = [x, *(p for p in layer.parameters() if p.requires_grad)]

            def fwd(layer=layer, x=x):
                with torch.no_grad():
                    return layer(x)

            def fwdbwd(layer=layer, inputs=inputs, x=x, dy=dy):
                return torch.autograd.grad(layer(x), inputs, dy)

            fwd_ms = do_bench(fwd, warmup=25, rep=args.reps, return_mode="median")
            fwdbwd_ms = do_bench(fwdbwd, warmup=25, rep=args.reps, return_mode="median")
            # Host time to enqueue one fwd+bwd: above the GPU time, the GPU waits for Python.
            fwdbwd_host_ms = host_ms(fwdbwd)
            base = base or (fwd_ms, fwdbwd_ms)
            row = {
                "shape": [M, K, N, r], "layer": name, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                "fwd_vs_plain": fwd_ms / base[0], "fwdbwd_vs_plain": fwdbwd_ms / base[1],
                "fwdbwd_host_ms": fwdbwd_host_ms,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{M:>5} {K:>5} {N:>5} {r:>4} {name:>26} {fwd_ms:8.3f} {fwdbwd_ms:9.3f} "
                f"{row['fwd_vs_plain']:6.3f} {row['fwdbwd_vs_plain']:6.3f} {fwdbwd_host_ms:10.3f}",
                flush=True,
            )
            if args.profile:
                profile_table(name, fwdbwd)
    meta = {"date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "world_size": 1,
            "backend": "nccl", "command": "python " + " ".join(sys.argv)}  # fmt: skip
    if args.out:
        write_json(args.out, {"meta": meta, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
