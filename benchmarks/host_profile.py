"""Where the host time of one LoRA fwd+bwd goes (needs CUDA): per-step timings, then a cProfile.

    python benchmarks/host_profile.py                          # M = 2048, 4096 -> 4096, r = 16, bf16
    python benchmarks/host_profile.py --shape 8192,4096,4096,16 --out host.json

At M = 2048 our fwd+bwd is host-bound (the GPU work is ~0.3 ms). Per step of the path it prints the host
microseconds per call (a loop without synchronisation) next to the GPU microseconds of one call on an idle
GPU (CUDA events around it, launch latency included). Then the autograd legs of one fwd+bwd (forward,
hand-off to the device thread, our backward there, hand-back), and the per-repetition time of fwd+bwd as
``do_bench`` takes it (``bench_lora.py``'s numbers), with and without its L2 clear, for our layer, our torch
backend and plain torch ops. ``--cprofile N`` profiles N layer forwards plus fused backwards on the main
thread; ``--trace`` writes a torch.profiler trace of a few ``do_bench``-style repetitions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import LoRAConfig, LoRALinear, kernels  # noqa: E402
from parallel_lora.dtypes import canonicalize  # noqa: E402
from parallel_lora.functional import check_inputs, resolve_backend  # noqa: E402
from parallel_lora.kernels import configs  # noqa: E402
from parallel_lora.kernels.dx_grads import lora_dx_and_grads  # noqa: E402
from parallel_lora.kernels.gemm import lora_gemm  # noqa: E402
from parallel_lora.kernels.rank_reduce import lora_adapter_grads  # noqa: E402
from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402
from parallel_lora.kernels.shrink_gemm import lora_shrink_gemm  # noqa: E402


def measure(fn, iters: int) -> tuple[float, float, int]:
    """``(host us, GPU us, new binds)`` of one call of ``fn`` after two warm-up calls: the host's wall time per
    call in a loop without synchronisation; the GPU time of one call on an idle GPU (CUDA events around it,
    the smallest of 20, so a step whose GPU time exceeds its host time is GPU-bound in the loop); and how
    many kernels were bound during the timed calls (0 unless a launch signature never repeats)."""
    fn()
    fn()
    torch.cuda.synchronize()
    bound = len(configs._BOUND)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    gpu = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(20):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return host, min(gpu), len(configs._BOUND) - bound


def rep_times(fn, clear_l2: bool, reps: int = 200) -> float:
    """Median GPU microseconds between CUDA events around ``fn`` over back-to-back repetitions, as
    ``triton.testing.do_bench`` times them, with or without its L2 clear before each repetition."""
    from triton import runtime

    cache = runtime.driver.active.get_empty_cache_for_benchmark()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if clear_l2:
            runtime.driver.active.clear_cache(cache)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) * 1e3 for start, end in events)
    return times[len(times) // 2]


def autograd_timeline(layer, x, inputs, dy, iters: int) -> dict[str, float]:
    """Median host microseconds of each leg of ``autograd.grad(layer(x), inputs, dy)``: the forward, the
    engine's hand-off to its device thread, our backward there, and the hand-back to the main thread."""
    from parallel_lora.functional import LoRALinearFunction

    stamps: list[float] = []
    backward = LoRALinearFunction.backward

    def timed_backward(ctx, dy):
        stamps.append(time.perf_counter())
        out = backward(ctx, dy)
        stamps.append(time.perf_counter())
        return out

    LoRALinearFunction.backward = staticmethod(timed_backward)
    legs: dict[str, list[float]] = {"forward": [], "hand-off": [], "backward": [], "hand-back": [], "total": []}
    try:
        for i in range(iters + 2):
            stamps.clear()
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            torch.autograd.grad(y, inputs, dy)
            t4 = time.perf_counter()
            t2, t3 = stamps
            if i >= 2:
                for leg, dt in zip(legs, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                    legs[leg].append(dt * 1e6)
    finally:
        LoRALinearFunction.backward = staticmethod(backward)
    torch.cuda.synchronize()
    return {leg: sorted(v)[len(v) // 2] for leg, v in legs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048,4096,4096,16", help="M,K,N,r")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--cprofile", type=int, default=50, help="fwd+bwd iterations under cProfile (0: skip)")
    parser.add_argument("--out", default="")
    parser.add_argument("--trace", default="", help="write a torch.profiler Chrome trace of do_bench-style reps")
    args = parser.parse_args()
    M, K, N, r = (int(v) for v in args.shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    layer = LoRALinear(K, N, LoRAConfig(r=r, alpha=2 * r, backend="triton"), dtype=dt, device=dev)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    W, A, B, s = layer.weight, layer.lora_A.weight, layer.lora_B.weight, layer.scale
    x = torch.randn(M, K, device=dev, dtype=dt)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(M, N, device=dev, dtype=dt)
    Ad, Bd = A.detach(), B.detach()
    _, S = kernels.forward(x, W, None, Ad, Bd, s, None)
    G = lora_shrink(dy, Bd, s)
    lora_inputs = [xg, A, B]

    def layer_fwd():
        with torch.enable_grad():
            return layer(xg)

    def layer_fwdbwd():
        y = layer(xg)
        return torch.autograd.grad(y, lora_inputs, dy)

    eager_layer = LoRALinear(K, N, LoRAConfig(r=r, alpha=2 * r, backend="torch"), dtype=dt, device=dev)
    eager_inputs = [xg, eager_layer.lora_A.weight, eager_layer.lora_B.weight]

    def eager_fwdbwd():
        return torch.autograd.grad(eager_layer(xg), eager_inputs, dy)

    steps = {
        "check_inputs": lambda: check_inputs(x, W, None, A, B, s),
        "resolve_backend": lambda: resolve_backend("triton", x.device),
        "canonicalize": lambda: canonicalize(x, W, None, A, B, cast_adapters=True),
        "kernels._check_sizes": lambda: kernels.lora._check_sizes(x, W, Ad, Bd),
        "lora_shrink(x)": lambda: lora_shrink(x, Ad.t(), s),
        "lora_gemm(y)": lambda: lora_gemm(x, W.t(), None, S, Bd.t()),
        "lora_shrink(dy)": lambda: lora_shrink(dy, Bd, s),
        "lora_gemm(dx)": lambda: lora_gemm(dy, W, None, G, Ad),
        "lora_adapter_grads": lambda: lora_adapter_grads(x, G, dy, S),
        "lora_shrink_gemm (fused y)": lambda: lora_shrink_gemm(x, W, True, None, Ad.t(), Bd.t(), s),
        "lora_dx_and_grads (fused dx)": lambda: lora_dx_and_grads(dy, W, False, G, Ad, x, S),
        "kernels.forward": lambda: kernels.forward(x, W, None, Ad, Bd, s, None),
        "kernels.backward_unchecked": lambda: kernels.backward_unchecked(dy, x, W, Ad, Bd, S, s, None),
        "LoRALinear forward (grad on)": layer_fwd,
        "LoRALinear fwd+bwd": layer_fwdbwd,
        "torch-backend LoRALinear fwd+bwd": lambda: eager_fwdbwd(),
        "F.linear fwd+bwd": lambda: torch.autograd.grad(torch.nn.functional.linear(xg, W), [xg], dy),
    }
    rows = []
    print(f"{'step':>32} | {'host us':>8} | {'GPU us':>8} | new binds")
    for name, fn in steps.items():
        host, gpu, binds = measure(fn, args.iters)
        rows.append({"step": name, "host_us": host, "gpu_us": gpu, "new_binds": binds})
        print(f"{name:>32} | {host:8.1f} | {gpu:8.1f} | {binds}", flush=True)
    timeline = autograd_timeline(layer, xg, lora_inputs, dy, args.iters)
    print("one fwd+bwd through autograd, median us: " + ", ".join(f"{k} {v:.1f}" for k, v in timeline.items()))
    # bench_lora.py times with do_bench, which clears L2 (a 256 MB memset) before every repetition and reads
    # CUDA events around each; the same repetitions without the clear tell the memset's share apart.
    A2, B2 = A.detach().clone().requires_grad_(True), B.detach().clone().requires_grad_(True)

    def plain_fwdbwd():  # bench_lora.py's torch_eager: separate matmuls, scale, add
        y = torch.nn.functional.linear(xg, W) + (xg @ A2.t()) @ B2.t() * s
        return torch.autograd.grad(y, [xg, A2, B2], dy)

    per_rep = {}
    for name, fn in (("LoRALinear", layer_fwdbwd), ("torch backend", eager_fwdbwd), ("plain ops", plain_fwdbwd)):
        per_rep[name] = {"do_bench": rep_times(fn, clear_l2=True), "no L2 clear": rep_times(fn, clear_l2=False)}
        cells = ", ".join(f"{k} {v:.1f}" for k, v in per_rep[name].items())
        print(f"{name} fwd+bwd, median us per repetition: {cells}")
    profile_text = ""
    if args.cprofile:
        layer_fwd()
        kernels.backward_unchecked(dy, x, W, Ad, Bd, S, s, None)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile):
            layer_fwd()
            kernels.backward_unchecked(dy, x, W, Ad, Bd, S, s, None)
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        profile_text = buf.getvalue()
        print(f"cProfile, {args.cprofile} x (LoRALinear forward + kernels.backward_unchecked), by own time:")
        print(profile_text)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        # Without Python stacks (they inflate host time several-fold): do_bench-style repetitions of each.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rep_times(layer_fwdbwd, clear_l2=True, reps=5)
            rep_times(eager_fwdbwd, clear_l2=True, reps=5)
        prof.export_chrome_trace(args.trace)
    if args.out:
        out = {"shape": [M, K, N, r], "gpu": torch.cuda.get_device_name(), "rows": rows, "timeline": timeline,
               "per_rep": per_rep,
               "cprofile": profile_text}
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
