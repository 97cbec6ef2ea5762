"""Compile the LoRA kernels for Hopper on any machine, no GPU needed, and report what the compiler made of them.

    python tools/compile_hopper.py                              # 8192 x 4096 -> 4096, r = 16, every launch
    python tools/compile_hopper.py --shape 8192,4096,14336,64 --launches dx_grads,dx_grads_drop --sass sass/

The library's launchers run on CPU tensors with the GPU's choices (the TMA path, ``--sms`` SMs, Hopper dot
options: not the interpreter's) and ``launcher.bind`` stubbed, which captures each launch's arguments. Every
config of the kernel's autotune list is then compiled for ``sm_90a`` exactly as Triton specializes it at that
launch (its own binder: ints divisible by 16 and 16-byte-aligned pointers marked, ``do_not_specialize``
arguments left alone); a hand-written signature without those hints compiles a different kernel. For each it
prints the registers and the local memory (spills) of the cubin, the shared memory against the library's
estimate (``KernelSpec.smem``, which pruning trusts), and, for the loops that issue wgmma (HGMMA), their length
and the longest run of other instructions between two HGMMAs: integer work placed there delays the tensor
cores. ``--sass DIR`` also writes each kernel's SASS. Run it with the Triton the GPU machine has for the numbers
that matter there. A helper of ``tests/kernels/test_compile.py``, not a test module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallel_lora.kernels as kernels  # noqa: E402
from parallel_lora.kernels import adapter_grads, dx_grads, gemm, launcher, shrink, shrink_db, shrink_gemm  # noqa: E402
from parallel_lora.kernels.host import pad_rank  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory a block may use on the H100 / H200
TARGET = triton.backends.compiler.GPUTarget("cuda", 90, 32)
INTEGER_OPS = ("LOP3", "IMAD", "SHF", "IADD3", "ISETP", "SEL", "PRMT", "VIADD", "LEA", "IABS", "IMNMX")


def capture_launches(
    M: int, K: int, N: int, r: int, sms: int, adapters: torch.dtype = torch.bfloat16
) -> dict[str, tuple]:
    """``{launch name: (spec, kernel, args, consts)}`` of the op's launches at this shape, bf16 (the adapters in
    ``adapters``), run on CPU
    tensors with the GPU's choices and the launch stubbed. Patches the kernel modules for good: a script's job."""
    os.environ.pop("TRITON_INTERPRET", None)  # the launchers ask at call time: the GPU's choices, not the interpreter's
    captured = []

    def capture(spec, kernel, signature, tensors, runtime, build):
        static, _grid, consts = build()
        captured.append((spec, kernel, (*tensors, *static, *runtime), consts))

    def tma_rows(t: torch.Tensor) -> bool:  # gemm_tma.tma_rows without its device check
        row_stride, col_stride = t.stride()
        return t.dtype in (torch.float16, torch.bfloat16) and col_stride == 1 and row_stride % 8 == 0

    launcher.bind = capture
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in (("tma_rows", tma_rows), ("sm_count", lambda index: sms)):
            if hasattr(module, name):
                setattr(module, name, value)
    adapter_grads._num_programs_target = lambda device: 2 * sms

    dt, s = torch.bfloat16, 2.0
    x, dy = torch.randn(M, K, dtype=dt), torch.randn(M, N, dtype=dt)
    W, A, B = torch.randn(N, K, dtype=dt), torch.randn(r, K, dtype=adapters), torch.randn(N, r, dtype=adapters)
    S, G = torch.randn(M, r, dtype=dt), torch.randn(M, r, dtype=dt)
    drop = {"p": 0.1, "seed": torch.tensor([1])}  # the call's seed, [1] int64 (read in device memory)
    calls = {
        "gemm_y": lambda: gemm.lora_gemm(x, W.t(), None, S, B.t()),
        "gemm_dx": lambda: gemm.lora_gemm(dy, W, None, G, A),
        "gemm_dx_drop": lambda: gemm.lora_gemm(dy, W, None, G, A, lora_drop=True, **drop),
        # Column-major x / dy: no TMA descriptor reads them, so these take the portable pointer kernel.
        "gemm_y_ptr": lambda: gemm.lora_gemm(x.t().contiguous().t(), W.t(), None, S, B.t()),
        "gemm_dx_drop_ptr": lambda: gemm.lora_gemm(dy.t().contiguous().t(), W, None, G, A, lora_drop=True, **drop),
        "shrink_S": lambda: shrink.lora_shrink(x, A.t(), s),
        "shrink_S_drop": lambda: shrink.lora_shrink(x, A.t(), s, drop_pre=True, **drop),
        "shrink_G": lambda: shrink.lora_shrink(dy, B, s),
        "reduce": lambda: adapter_grads.lora_adapter_grads(x, G, dy, S),
        "reduce_drop": lambda: adapter_grads.lora_adapter_grads(x, G, dy, S, drop_x=True, **drop),
        "shrink_gemm": lambda: shrink_gemm.lora_shrink_gemm(x, W, True, None, A, B, s),
        "shrink_gemm_drop": lambda: shrink_gemm.lora_shrink_gemm(x, W, True, None, A, B, s, drop_post=True,
                                                                 **drop),  # fmt: skip
        "dx_grads": lambda: dx_grads.lora_dx_and_grads(dy, W, False, G, A, x, S),
        "dx_grads_drop": lambda: dx_grads.lora_dx_and_grads(dy, W, False, G, A, x, S, lora_drop=True, **drop),
        "shrink_db": lambda: shrink_db.lora_shrink_db(dy, B, S, s),
        "dx_grads_db_sums": lambda: dx_grads.lora_dx_and_grads(
            dy, W, False, G, A, x, None, db_partials=torch.empty(0), db_parts=shrink_db.db_blocks(M)
        ),
    }
    if pad_rank(r) > shrink_db.MAX_DB_R_PAD:  # the backward takes G with dB's partials up to that rank only
        del calls["shrink_db"], calls["dx_grads_db_sums"]
    launches = {}
    for name, call in calls.items():
        captured.clear()
        call()
        (launches[name],) = captured
    return launches


def compile_config(kernel, args: tuple, consts: dict, cfg: triton.Config):
    """``kernel`` compiled for sm_90a with ``args`` and ``consts`` as Triton's own launch path would (its binder
    and argument packing), at config ``cfg``."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**consts, **cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers per thread, local memory bytes per thread)`` of the cubin's kernel (``cuobjdump -res-usage``:
    its ``STACK`` frame, where spilled registers go, plus any ``LOCAL`` arrays: ``LOCAL`` alone stays 0 with
    spills)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", out)
    local = sum(int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", out))
    return int(regs.group(1)) if regs else -1, local


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout


def wgmma_loops(sass: str) -> list[dict]:
    """The innermost loops (backward branches) of ``sass`` that issue HGMMA (the K loops): length, integer
    instructions, and the longest run of other instructions between two HGMMAs of one pass through the loop."""
    ins, labels = [], {}
    for line in sass.splitlines():
        line = line.strip()
        label = re.match(r"^\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
            continue
        op = re.match(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if op:
            ins.append((op.group(1).split(".")[0], line))
    spans = []
    for end, (op, line) in enumerate(ins):
        target = re.search(r"BRA `\(\.(L_x_\d+)\)", line) if op == "BRA" else None
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < end and any(o == "HGMMA" for o, _ in ins[start : end + 1]):
            spans.append((start, end))
    loops = []
    for start, end in spans:
        if any(start <= a and b <= end and (a, b) != (start, end) for a, b in spans):
            continue  # an outer loop (the persistent tile loop): its inner loop is reported
        body = [o for o, _ in ins[start : end + 1]]
        hgmma = [i for i, o in enumerate(body) if o == "HGMMA"]
        gaps = [b - a - 1 for a, b in zip(hgmma, hgmma[1:], strict=False)]
        loops.append({"instructions": len(body), "hgmma": len(hgmma), "integer": sum(o in INTEGER_OPS for o in body),
                      "max_gap": max(gaps, default=0)})  # fmt: skip
    return loops


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192,4096,4096,16", help="M,K,N,r")
    parser.add_argument("--launches", default="", help="comma-separated subset (default: every launch)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the launchers size their grids for")
    parser.add_argument("--sass", default="", help="directory to write each kernel's SASS into")
    parser.add_argument("--adapters", default="bf16", choices=("bf16", "fp32"), help="the adapters' dtype")
    args = parser.parse_args()
    M, K, N, r = (int(v) for v in args.shape.split(","))
    adapters = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.adapters]
    launches = capture_launches(M, K, N, r, args.sms, adapters)
    wanted = set(args.launches.split(",")) if args.launches else set(launches)
    print(f"triton {triton.__version__}, sm_90a, M,K,N,r = {M},{K},{N},{r}, {args.adapters} adapters")
    print(f"{'launch':>17} {'config':>34} {'regs':>5} {'local':>6} {'smem':>7} {'est':>7}  wgmma loops")
    bad = []
    for name, (spec, kernel, call_args, consts) in launches.items():
        if name not in wanted:
            continue
        elem = torch.tensor([], dtype=torch.bfloat16).element_size()
        sizes = dict(zip(kernel.arg_names, call_args, strict=False))
        for cfg in spec.configs():
            est = spec.smem(cfg.kwargs, cfg.num_stages, elem, {**sizes, **consts})
            label = "x".join(str(v) for v in cfg.kwargs.values()) + f" s{cfg.num_stages} w{cfg.num_warps}"
            if est > SMEM_LIMIT:
                print(f"{name:>17} {label:>34} {'':>5} {'':>6} {'pruned':>7} {est:>7}")
                continue
            try:
                compiled = compile_config(kernel, call_args, consts, cfg)
            except Exception as exc:  # the estimate let through what the compiler refuses
                print(f"{name:>17} {label:>34} failed: {type(exc).__name__}: {str(exc)[:80]}")
                bad.append((name, label, "compile failed"))
                continue
            regs, spills = resource_usage(compiled.asm["cubin"])
            smem = compiled.metadata.shared
            sass = sass_of(compiled.asm["cubin"])
            if args.sass:
                Path(args.sass).mkdir(parents=True, exist_ok=True)
                (Path(args.sass) / f"{name}_{label.replace(' ', '_')}.sass").write_text(sass)
            loops = " ".join(f"[{lp['instructions']} ins, {lp['hgmma']} hgmma, {lp['integer']} int, gap "
                             f"{lp['max_gap']}]" for lp in wgmma_loops(sass))  # fmt: skip
            print(f"{name:>17} {label:>34} {regs:>5} {spills:>6} {smem:>7} {est:>7}  {loops}", flush=True)
            if smem > est or spills:
                why = f"smem {smem} > estimate {est}" if smem > est else f"{spills} B of local memory (spills)"
                bad.append((name, label, why))
    for name, label, why in bad:
        print(f"CHECK {name} {label}: {why}")


if __name__ == "__main__":
    main()
