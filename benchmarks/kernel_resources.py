"""Registers, spills and shared memory of every kernel the LoRA op compiles at a shape (needs CUDA).

    python benchmarks/kernel_resources.py                          # 8192 x 4096 -> 4096, r = 0 / 16 / 64
    python benchmarks/kernel_resources.py --shape 8192,4096,4096 --ranks 16 --out resources.json

Runs forward and backward (with and without "pre" dropout) through ``parallel_lora.kernels`` once per rank,
then prints, for each compiled kernel in the launch cache, its config and what the compiler reports:
``n_regs`` per thread, ``n_spills`` (registers spilled to local memory), and ``shared`` bytes. A rank of 0
runs the GEMMs with an empty rank term (the bare GEMM core), the baseline for what the rank term costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import kernels  # noqa: E402
from parallel_lora.dropout import Dropout  # noqa: E402
from parallel_lora.kernels import configs  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402


def compile_all(M: int, K: int, N: int, r: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    W = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=dt)
    if r == 0:
        lora_gemm(x, W.t(), None, torch.empty(M, 0, device=dev, dtype=dt), torch.empty(0, N, device=dev, dtype=dt))
        lora_gemm(dy, W, None, torch.empty(M, 0, device=dev, dtype=dt), torch.empty(0, K, device=dev, dtype=dt))
        return
    A = torch.randn(r, K, device=dev, dtype=dt) / K**0.5
    B = torch.randn(N, r, device=dev, dtype=dt) / r**0.5
    for drop in (None, Dropout(p=0.1, seed=1, position="pre")):
        _, S = kernels.forward(x, W, None, A, B, 2.0, drop)
        kernels.backward(dy, x, W, A, B, S, 2.0, drop)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192,4096,4096", help="M,K,N")
    parser.add_argument("--ranks", default="0,16,64", help="comma-separated LoRA ranks")
    parser.add_argument("--out", default="", help="JSON path")
    args = parser.parse_args()
    M, K, N = (int(v) for v in args.shape.split(","))
    for r in (int(v) for v in args.ranks.split(",")):
        compile_all(M, K, N, r)
    torch.cuda.synchronize()
    rows = []
    print(f"{'kernel':>28} {'sizes':>28} {'consts':>44} {'config':>40} {'regs':>5} {'spills':>6} {'smem':>7}")
    for key, bound in configs._BOUND.items():
        kernel_name, compiled, consts, cfg = key[1], bound.compiled, bound.consts, bound.config.kwargs
        sizes = bound.static[: 3 if key[0] == "shrink" else 4]  # M and the layer's sizes lead the size arguments
        compiled._init_handles()
        row = {
            "kernel": kernel_name, "sizes": list(sizes), "consts": consts, "config": cfg,
            "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages,
            "n_regs": compiled.n_regs, "n_spills": compiled.n_spills, "shared": compiled.metadata.shared,
        }  # fmt: skip
        rows.append(row)
        short = {k: v for k, v in consts.items() if k in ("W_NK", "LORA_DROP", "R_PAD", "BLOCK_R", "DROP_PRE")}
        config = f"{cfg} w{row['num_warps']} s{row['num_stages']}"
        print(f"{kernel_name:>28} {str(sizes):>28} {str(short):>44} {config:>40} {row['n_regs']:>5} "
              f"{row['n_spills']:>6} {row['shared']:>7}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": [M, K, N], "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
