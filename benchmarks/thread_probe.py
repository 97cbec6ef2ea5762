"""Why is the same Python slower on autograd's device thread? Times small host operations per thread (needs CUDA).

    python benchmarks/thread_probe.py                    # M = 2048, 4096 -> 4096, r = 16, bf16
    python benchmarks/thread_probe.py --shape 8192,4096,4096,16 --out probe.json

Each probe is a host-only loop (no synchronisation inside), run in three places:

- ``main``      the main thread;
- ``pool``      a persistent worker thread (``ThreadPoolExecutor``);
- ``autograd``  inside ``backward`` of a custom ``autograd.Function``, i.e. on autograd's CUDA device thread,
                where ``LoRALinearFunction.backward`` runs.

Per probe it prints microseconds per call in each place (wall, and that thread's CPU time). A probe that is
slow only in ``autograd`` names the cost the backward pays there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import kernels  # noqa: E402
from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402


def measure(fn, iters: int) -> tuple[float, float]:
    """(wall us, thread-CPU us) per call of ``fn`` after one warm-up call."""
    fn()
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - w0) / iters * 1e6, (time.thread_time() - c0) / iters * 1e6


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward runs ``ctx.probe()`` on autograd's device thread and keeps its result."""

    @staticmethod
    def forward(ctx, x, probe, out):
        ctx.probe, ctx.out = probe, out
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        ctx.out.append(ctx.probe())
        return dy, None, None


def in_autograd(probe):
    x = torch.zeros(1, device="cuda", requires_grad=True)
    out: list = []
    torch.autograd.grad(_RunInBackward.apply(x, probe, out), [x], torch.ones_like(x))
    return out[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048,4096,4096,16", help="M,K,N,r")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    M, K, N, r = (int(v) for v in args.shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=dt)
    W = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    A = torch.randn(r, K, device=dev, dtype=dt) / K**0.5
    B = torch.randn(N, r, device=dev, dtype=dt) * 0.02
    dy = torch.randn(M, N, device=dev, dtype=dt)
    _, S = kernels.forward(x, W, None, A, B, 2.0, None)
    from triton.runtime import driver

    def pure_python():
        s = 0
        for i in range(100):
            s += i * i
        return s

    probes = {
        "pure python (100 mults)": pure_python,
        "torch.empty cuda": lambda: torch.empty(1024, device=dev),
        "torch.cuda.current_device": torch.cuda.current_device,
        "triton get_current_stream": lambda: driver.active.get_current_stream(0),
        "tensor.data_ptr": x.data_ptr,
        "x.t() view": x.t,
        "lora_shrink launch": lambda: lora_shrink(dy, B, 2.0),
        "kernels.backward": lambda: kernels.backward(dy, x, W, A, B, S, 2.0, None),
        "kernels.backward_unchecked": lambda: kernels.backward_unchecked(dy, x, W, A, B, S, 2.0, None),
        "kernels.forward": lambda: kernels.forward(x, W, None, A, B, 2.0, None),
    }
    pool = ThreadPoolExecutor(max_workers=1)
    rows = []
    print(f"{'probe':>28} | {'main wall/cpu us':>17} | {'pool wall/cpu us':>17} | {'autograd wall/cpu us':>21}")
    for name, fn in probes.items():
        iters = args.iters if "kernels" not in name else 20

        def probe(fn=fn, iters=iters):
            return measure(fn, iters)

        main_t = probe()
        pool_t = pool.submit(probe).result()
        auto_t = in_autograd(probe)
        torch.cuda.synchronize()
        rows.append({"probe": name, "main": main_t, "pool": pool_t, "autograd": auto_t})
        cells = [f"{w:8.1f}/{c:8.1f}" for w, c in (main_t, pool_t, auto_t)]
        print(f"{name:>28} | {cells[0]:>17} | {cells[1]:>17} | {cells[2]:>21}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": [M, K, N, r], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
