"""Where the time of one LoRA layer call goes, layer by layer of our stack (needs CUDA).

    python benchmarks/profile_op.py                          # 8192 x 4096 -> 4096, r = 16, bf16
    python benchmarks/profile_op.py --shape 8192,4096,14336,16 --trace trace.json

Times forward+backward (W frozen, grads of x, A, B) through each layer of the stack, so the difference
between two neighbours is what that layer adds:

- ``cublas``         ``F.linear`` forward + its dx GEMM via autograd (the base layer)
- ``kernels``        ``parallel_lora.kernels.forward`` + ``backward`` called directly (no autograd)
- ``kernels_thread`` the same, with ``backward`` in a fresh Python thread (autograd runs CUDA backward on
                     its own device thread: this isolates per-thread costs such as Triton's context setup)
- ``function``       ``LoRALinearFunction.apply`` + ``torch.autograd.grad``
- ``module``         ``LoRALinear(x)`` + ``torch.autograd.grad`` (what ``launch/bench_lora.py`` times)

each as a GPU-timed median (``do_bench``) and as host time per call (enqueue only, no sync: when it is
above the GPU time, the GPU waits for Python). Then it profiles ``module`` with ``torch.profiler`` and
prints the top CUDA kernels and CPU ops. Writes the numbers as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import LoRAConfig, LoRALinear, kernels  # noqa: E402
from parallel_lora.functional import LoRALinearFunction  # noqa: E402


def host_ms(fn, iters: int = 50) -> float:
    """Host time per call of ``fn`` with no synchronisation inside the loop."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3


def in_thread(fn):
    def run():
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    return run


def python_profile(cases: dict, calls: int = 20) -> None:
    """cProfile ``kernels.backward`` where it runs (cProfile sees only the thread that enables it, hence the
    wrapper), with its wall time next to the CPU time of the thread that ran it: wall far above CPU means
    the thread waited (GIL, locks), CPU time close to wall means the Python work itself is slower there."""
    import cProfile
    import pstats

    inner = kernels.backward
    for name, fn in cases.items():
        prof = cProfile.Profile()
        wall = cpu = 0.0

        def wrapped(*a, prof=prof, **k):
            nonlocal wall, cpu
            w0, c0 = time.perf_counter(), time.thread_time()
            prof.enable()
            try:
                return inner(*a, **k)
            finally:
                prof.disable()
                wall += time.perf_counter() - w0
                cpu += time.thread_time() - c0

        kernels.backward = wrapped
        try:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        finally:
            kernels.backward = inner
        wall_ms, cpu_ms = wall / calls * 1e3, cpu / calls * 1e3
        print(f"--- kernels.backward in {name}: wall {wall_ms:.3f} ms, thread CPU {cpu_ms:.3f} ms")
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192,4096,4096,16", help="M,K,N,r")
    parser.add_argument("--trace", default="", help="write a chrome trace of the profiled module calls here")
    parser.add_argument("--out", default="", help="write the timings as JSON here")
    parser.add_argument("--cprofile", action="store_true", help="cProfile kernels.backward in each thread")
    args = parser.parse_args()
    from triton.testing import do_bench

    M, K, N, r = (int(v) for v in args.shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    cfg = LoRAConfig(r=r, alpha=2 * r, backend="triton")
    layer = LoRALinear(K, N, cfg, dtype=dt, device=dev)
    nn.init.normal_(layer.lora_B.weight, std=0.02)
    W, A, B, s = layer.weight, layer.lora_A.weight, layer.lora_B.weight, cfg.scale
    x = torch.randn(M, K, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(M, N, device=dev, dtype=dt)
    xd, Ad, Bd = x.detach(), A.detach(), B.detach()

    def cublas():
        return torch.autograd.grad(F.linear(x, W), [x], dy)

    def direct_fwd():
        return kernels.forward(xd, W, None, Ad, Bd, s, None)

    def direct():
        _, S = direct_fwd()
        return kernels.backward(dy, xd, W, Ad, Bd, S, s, None)

    def direct_thread():
        _, S = direct_fwd()
        return in_thread(lambda: kernels.backward(dy, xd, W, Ad, Bd, S, s, None))()

    pool = ThreadPoolExecutor(max_workers=1)

    def direct_pool():
        _, S = direct_fwd()
        return pool.submit(kernels.backward, dy, xd, W, Ad, Bd, S, s, None).result()

    def function():
        y = LoRALinearFunction.apply(x, W, None, A, B, s, None, "triton")
        return torch.autograd.grad(y, [x, A, B], dy)

    def module():
        return torch.autograd.grad(layer(x), [x, A, B], dy)

    cases = {
        "cublas": cublas, "kernels": direct, "kernels_thread": direct_thread, "kernels_pool": direct_pool,
        "function": function, "module": module, "kernels_fwd": direct_fwd,
    }  # fmt: skip
    rows = []
    print(f"{'case':>16} {'gpu_ms':>8} {'host_ms':>8}")
    for name, fn in cases.items():
        gpu = do_bench(fn, warmup=25, rep=200, return_mode="median")
        host = host_ms(fn)
        rows.append({"case": name, "gpu_ms": gpu, "host_ms": host})
        print(f"{name:>16} {gpu:8.3f} {host:8.3f}", flush=True)

    if args.cprofile:
        import cProfile
        import pstats

        with torch.no_grad():
            for name, fn in (("kernels.forward", direct_fwd), ("LoRALinear forward", lambda: layer(x))):
                prof = cProfile.Profile()
                fn()
                prof.enable()
                for _ in range(100):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                print(f"--- cProfile of {name} (no_grad), 100 calls")
                pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        python_profile({"main thread": direct, "fresh thread": direct_thread, "pool thread": direct_pool,
                        "autograd thread": module})  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        module()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            module()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": [M, K, N, r], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
