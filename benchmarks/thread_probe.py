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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import LoRAConfig, LoRALinear, kernels  # noqa: E402
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


def _nothing():
    return None


def grad_of(make, inputs):
    """Build ``make()`` with grad mode on (the autograd thread runs with it off) and, given ``inputs``, take
    ``autograd.grad`` of it with a ones gradient."""
    with torch.enable_grad():
        y = make()
        return y if inputs is None else torch.autograd.grad(y, inputs, torch.ones_like(y))


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

    from parallel_lora.kernels import configs, shrink

    # The bound shrink kernel and the arguments of its last launch, to split one launch's host time into our
    # wrapper and Triton's own call of the compiled kernel.
    shrink_call: list = []
    launch = configs.launch

    def recording_launch(spec, kernel, signature, tensors, runtime, build):
        if spec.name == "shrink":
            shrink_call[:] = [spec, kernel, signature, tensors, runtime]
        return launch(spec, kernel, signature, tensors, runtime, build)

    shrink.launch = recording_launch
    lora_shrink(dy, B, 2.0)
    shrink.launch = launch
    spec, kernel, signature, tensors, runtime = shrink_call
    bound = configs._BOUND[configs.bound_key(spec, kernel, signature, tensors)]

    def pure_python():
        s = 0
        for i in range(100):
            s += i * i
        return s

    layer = LoRALinear(K, N, LoRAConfig(r=r, alpha=2 * r, backend="triton"), dtype=dt, device=dev)
    xg = x.detach().requires_grad_(True)
    lora_inputs = [xg, layer.lora_A.weight, layer.lora_B.weight]
    one = torch.ones(1, device=dev, requires_grad=True)

    probes = {
        "pure python (100 mults)": pure_python,
        "torch.empty cuda": lambda: torch.empty(1024, device=dev),
        "torch.cuda.current_device": torch.cuda.current_device,
        "triton get_current_stream": lambda: driver.active.get_current_stream(0),
        "tensor.data_ptr": x.data_ptr,
        "x.t() view": x.t,
        "lora_shrink launch": lambda: lora_shrink(dy, B, 2.0),
        "  its compiled-kernel call": lambda: bound.run(*tensors, *bound.static, *runtime, *bound.tail),
        "kernels.backward": lambda: kernels.backward(dy, x, W, A, B, S, 2.0, None),
        "kernels.backward_unchecked": lambda: kernels.backward_unchecked(dy, x, W, A, B, S, 2.0, None),
        "kernels.forward": lambda: kernels.forward(x, W, None, A, B, 2.0, None),
        # The engine's own cost: one autograd.grad hands the graph to the device thread and waits for it.
        "autograd.grad, 1-op CUDA graph": lambda: grad_of(lambda: one * 2.0, [one]),
        "autograd.grad, 1 Python Function": lambda: grad_of(lambda: _RunInBackward.apply(one, _nothing, []), [one]),
        "LoRALinear forward (grad on)": lambda: grad_of(lambda: layer(xg), None),
        "F.linear fwd+bwd (autograd)": lambda: grad_of(lambda: F.linear(xg, W), [xg]),
        "LoRALinear fwd+bwd (autograd)": lambda: grad_of(lambda: layer(xg), lora_inputs),
    }
    pool = ThreadPoolExecutor(max_workers=1)
    rows = []
    print(f"{'probe':>28} | {'main wall/cpu us':>17} | {'pool wall/cpu us':>17} | {'autograd wall/cpu us':>21}")
    for name, fn in probes.items():
        iters = 20 if "kernels" in name or "fwd+bwd" in name else args.iters

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
