"""Our Python per LoRA call with the kernel launches stubbed out (runs on the CPU, no GPU needed).

    python benchmarks/python_overhead.py            # M, K, N, r = 16, 64, 64, 16 (tiny: little CPU compute)
    python benchmarks/python_overhead.py --profile  # and a cProfile of the fwd+bwd, by own time
    python benchmarks/python_overhead.py --tp       # also the TP layers at world size 1 (gloo)

Every kernel launch is replaced by a no-op (the Triton interpreter is switched on only so that CPU tensors
pass the kernels' device check), so what is timed is the Python around the launches: the layer, the dtype
policy, the autograd Function, the kernel wrappers and the engine. A PEFT-style eager fwd+bwd of the same
tiny tensors is timed beside it for scale (its time includes tiny real matmuls). Best of 5 loops of
``--iters`` calls; microseconds per call.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_lora import LoRAConfig, LoRALinear  # noqa: E402
from parallel_lora.kernels import LAUNCH_MODULES, configs  # noqa: E402


def best_us(fn, iters: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def tp_rows(layer: LoRALinear, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """fwd+bwd of copies of ``layer`` as column- and row-parallel layers on a one-rank gloo mesh."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_lora import ColumnParallelLoRALinear, RowParallelLoRALinear

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29551")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    rows = {}
    for cls in (ColumnParallelLoRALinear, RowParallelLoRALinear):
        tp_layer = cls.from_lora_linear(copy.deepcopy(layer), mesh)
        inputs = [x, tp_layer.lora_A.weight, tp_layer.lora_B.weight]
        rows[f"{cls.__name__} fwd+bwd"] = lambda m=tp_layer, i=inputs: torch.autograd.grad(m(x), i, dy)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16,64,64,16", help="M,K,N,r")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tp", action="store_true", help="also Column/RowParallelLoRALinear on a 1-rank gloo mesh")
    args = parser.parse_args()
    M, K, N, r = (int(v) for v in args.shape.split(","))
    def no_launch(spec, kernel, signature, tensors, runtime, build):
        # What a first launch hands back on GPU, a Bound, here one whose kernel call does nothing: later calls
        # of a layout take the bound launch sites as they do on GPU.
        static = build()[0]
        return configs.Bound(spec.name, lambda *a: None, static, (), None, {}, None)

    for module in LAUNCH_MODULES:
        module.launch = no_launch
    torch.set_num_threads(1)
    dt = torch.bfloat16
    layer = LoRALinear(K, N, LoRAConfig(r=r, alpha=2 * r, backend="triton"), dtype=dt)
    x = torch.randn(M, K, dtype=dt, requires_grad=True)
    dy = torch.randn(M, N, dtype=dt)
    inputs = [x, layer.lora_A.weight, layer.lora_B.weight]
    A = torch.randn(r, K, dtype=dt, requires_grad=True)
    B = torch.randn(N, r, dtype=dt, requires_grad=True)

    def ours_fwdbwd():
        return torch.autograd.grad(layer(x), inputs, dy)

    def eager_fwdbwd():
        y = F.linear(x, layer.weight) + (x @ A.t()) @ B.t() * 2.0
        return torch.autograd.grad(y, [x, A, B], dy)

    rows = {
        "ours forward (launches stubbed)": lambda: layer(x),
        "ours fwd+bwd (launches stubbed)": ours_fwdbwd,
        "PEFT-style eager fwd+bwd (real CPU ops)": eager_fwdbwd,
    }
    if args.tp:
        rows.update(tp_rows(layer, x, dy))
    for name, fn in rows.items():
        print(f"{name:>42}: {best_us(fn, args.iters):7.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            ours_fwdbwd()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
