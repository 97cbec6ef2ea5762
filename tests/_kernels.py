"""Shared helpers of the ``tests/kernels/`` tests (the fused Triton LoRA op, ``parallel_lora.kernels``).

Reference: ``parallel_lora._eager`` (the oracle), run in fp64 on the *same* inputs (the kernel's inputs cast
up exactly), with the same ``Dropout``. On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``conftest``), so the shapes are small; ``tests/kernels/test_gpu.py`` runs the real shapes on CUDA.

Errors are measured elementwise against the magnitude of the terms each element sums,
``|out - ref| <= tol * mag`` with ``mag`` the same oracle run on ``|inputs|`` (dropout masks and scales are
non-negative, so ``mag`` is exactly ``sum |term|``): the standard floating-point bound for a sum of products,
which stays meaningful when the terms cancel (a small ``ref`` from large terms).
"""

from __future__ import annotations

import os

import pytest
import torch

from parallel_lora import _eager as eager
from parallel_lora._dropout import Dropout, seed_tensor

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if not (INTERPRETING or HAS_CUDA):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by conftest without CUDA)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from parallel_lora import kernels  # noqa: E402  (after the skip: importing defines the jit functions)
from parallel_lora.kernels import launcher, ops, program, replay  # noqa: E402
from parallel_lora.kernels.dropout_mask import drop_tile, hash_tile, mask_keys  # noqa: E402
from parallel_lora.kernels.host import cdiv, seed_arg  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# dtype -> max of |out - ref| / mag (see the module docstring), with the reason.
TOL = {
    # fp32 accumulation (tl.dot runs "ieee", not tf32) and one fp32 rounding: ~1e-7 observed.
    torch.float32: 1e-5,
    # the output's fp16 rounding (2^-11) plus that of the saved S / G feeding the next product.
    torch.float16: 2e-3,
    # the same two bf16 roundings: 2^-9 each on GPU (round to nearest); the interpreter converts
    # fp32 -> bf16 by truncation (up to 2^-7 each).
    torch.bfloat16: 2e-2,
}
DTYPES = list(TOL)
# GPU rounds fp32 -> bf16 to nearest (two roundings of 2^-9); fp32 sums up to 4096 terms.
GPU_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}

SCALE = 2.0  # alpha / r != 1, so a missing or doubled scale is visible

DROPOUTS = {
    "none": None,
    # k_offset != 0: a row-parallel shard whose first input column is global column 5.
    "pre": Dropout(p=0.3, seed=seed_tensor(123_456_789_012, DEVICE), position="pre", k_offset=5),
    # An even offset: each pair of columns is one hash word (an odd one is compiled apart, drop_tile's ODD).
    "pre_even": Dropout(p=0.3, seed=seed_tensor(2**50 + 1, DEVICE), position="pre", k_offset=96),
    "post": Dropout(p=0.25, seed=seed_tensor(77, DEVICE), position="post"),
}

# Every kernel spec's name (``KernelSpec.name``): what the op's launches can be.
LAUNCH_NAMES = ("shrink", "gemm", "gemm_tma", "adapter_grads", "dx_grads", "shrink_gemm", "shrink_db")


def rel_err(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    """max |out - ref| / mag; an element whose terms are all zero must come out exactly zero."""
    if ref.numel() == 0:
        return 0.0
    diff = (out.double() - ref).abs()
    return (diff / mag.clamp_min(1e-300)).max().item()


def assert_matches(name, out, ref, mag, dtype, tol=None) -> None:
    assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = rel_err(out, ref, mag)
    tol = TOL[dtype] if tol is None else tol
    assert err <= tol, f"{name}: error {err:.3e} of the terms' magnitude > {tol:.1e} ({dtype})"


def skip_without_tma() -> None:
    """Skip on a CUDA GPU older than Hopper, which has no TMA (the interpreter emulates it)."""
    if HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("no TMA before Hopper")


def make_inputs(M, K, N, r, dtype, bias=True, device=DEVICE):
    """Unit-scale operands so the base and LoRA terms are the same size (neither hides the other)."""
    x = torch.randn(M, K, device=device).to(dtype)
    weight = (torch.randn(N, K, device=device) / max(K, 1) ** 0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    lora_A = (torch.randn(r, K, device=device) / max(K, 1) ** 0.5).to(dtype)
    lora_B = (torch.randn(N, r, device=device) / r**0.5).to(dtype)
    dy = torch.randn(M, N, device=device).to(dtype)
    return x, weight, b, lora_A, lora_B, dy


def _f64(t, absolute=False):
    if t is None:
        return None
    return t.double().abs() if absolute else t.double()


def reference(x, weight, b, lora_A, lora_B, dy, scale, dropout, absolute=False):
    """The eager oracle in fp64: ``(y, S, dx, dA, dB)``; with ``absolute``, the same on ``|inputs|``."""
    args = [_f64(t, absolute) for t in (x, weight, b, lora_A, lora_B, dy)]
    scale = abs(scale) if absolute else scale
    x, weight, b, lora_A, lora_B, dy = args
    y, s_lora = eager.forward(x, weight, b, lora_A, lora_B, scale, dropout)
    dx, dA, dB = eager.backward(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout)
    return y, s_lora, dx, dA, dB


def check_against_eager(x, weight, b, lora_A, lora_B, dy, scale, dropout, tol=None):
    dtype = x.dtype
    y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, scale, dropout)
    dx, dA, dB = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout)
    ref = reference(x, weight, b, lora_A, lora_B, dy, scale, dropout)
    mag = reference(x, weight, b, lora_A, lora_B, dy, scale, dropout, absolute=True)
    outs = (y, s_lora, dx, dA, dB)
    for name, out, want, m in zip(("y", "S", "dx", "dA", "dB"), outs, ref, mag, strict=True):
        assert_matches(name, out, want, m, dtype, tol)


def count_launches(monkeypatch) -> list[str]:
    """Record the kernel of every launch the LoRA kernels make (first launches of a layout and bound ones; on a
    GPU a signature's very first launch goes through Triton's path and is not seen), with replays off: every call
    goes through the launchers."""
    launched = []
    real = launcher.Bound.launch

    def spy(self, tensors, runtime):
        launched.append(self.name)
        return real(self, tensors, runtime)

    monkeypatch.setattr(launcher.Bound, "launch", spy)
    monkeypatch.setattr(program.Programs, "run", lambda self, call, operands, seed: call())
    monkeypatch.setattr(ops, "_programs", lambda *args: None)  # nor do the ops' C++ kernels keep any
    replay.forget()
    return launched


def patch_bind(monkeypatch, fn) -> None:
    """Route the first launch of every kernel signature (``launcher.bind``, the one seam) through ``fn``; a ``fn``
    returning None leaves the op's launch sites empty, so every call reaches it."""
    monkeypatch.setattr(launcher, "bind", fn)


# The keep-mask and uniforms as the kernels draw them, materialized by a tiny kernel of the kernels' own helpers.
@triton.jit
def uniform_tile(k_row, k_col, rows, cols):
    """Uniform fp32 in [0, 1) for the broadcast tile of ``rows`` x ``cols``, one hash per element (for tests:
    the kernels draw two elements per hash through ``drop_tile``): the half ``cols & 1`` of ``h(rows, cols >> 1)``
    times ``2**-16`` (exact)."""
    c = cols.to(tl.uint32)
    h = hash_tile(k_row, k_col, rows, c >> 1)
    return ((h >> ((c & 1) * 16)) & 0xFFFF).to(tl.float32) * 1.52587890625e-05


@triton.jit(do_not_specialize=["seed_salt", "col_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_dropout_mask_kernel(
    out_ptr,  # [rows, cols] uint8 keep-mask, or fp32 uniforms when WRITE_UNIFORM
    rows,
    cols,
    stride_om,
    stride_oc,
    p,
    seed_ptr,  # [1] int64: the call's seed is load(seed_ptr) + seed_salt
    seed_salt: tl.int64,
    col_offset,
    WRITE_UNIFORM: tl.constexpr,
    ODD_OFFSET: tl.constexpr,  # col_offset is odd
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_c[None, :] * stride_oc
    in_bounds = (offs_m[:, None] < rows) & (offs_c[None, :] < cols)
    k_row, k_col = mask_keys(seed_ptr, seed_salt, True)
    if WRITE_UNIFORM:
        u = uniform_tile(k_row, k_col, offs_m[:, None], col_offset + offs_c[None, :])
        tl.store(ptrs, u, mask=in_bounds)
    else:  # the kernels' own helper, so tests of this mask cover drop_tile (odd column offsets too)
        keep = drop_tile(tl.full((BLOCK_M, BLOCK_C), 1, tl.uint8), k_row, k_col, p, offs_m,
                         col_offset + tl.program_id(1) * BLOCK_C, ODD_OFFSET)  # fmt: skip
        tl.store(ptrs, keep, mask=in_bounds)


def _draw(seed, p: float, rows: int, cols: int, col_offset: int, device, uniform: bool, salt: int = 0) -> torch.Tensor:
    out = torch.empty(rows, cols, device=device, dtype=torch.float32 if uniform else torch.uint8)
    if rows == 0 or cols == 0:
        return out
    if not isinstance(seed, torch.Tensor):
        seed = (int(seed) + 2**63) % 2**64 - 2**63  # mod 2**64, in int64 as the kernels take it
    seed_ptr, seed_salt = seed_arg(seed, out)  # an int as the kernels take it: a scalar beside a zero in memory
    seed_salt += salt
    grid = (cdiv(rows, 32), cdiv(cols, 32))
    _lora_dropout_mask_kernel[grid](
        out, rows, cols, out.stride(0), out.stride(1), float(p), seed_ptr, seed_salt, int(col_offset),
        WRITE_UNIFORM=uniform, ODD_OFFSET=col_offset % 2 == 1, BLOCK_M=32, BLOCK_C=32,
    )  # fmt: skip
    return out


def dropout_keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """The ``[rows, cols]`` boolean keep-mask the kernels apply for ``dropout`` (columns shifted by
    ``k_offset`` for "pre"); equals ``parallel_lora._dropout.keep_mask``. For tests and debugging."""
    if dropout.position not in ("pre", "post"):
        raise ValueError(f"dropout.position must be 'pre' or 'post', got {dropout.position!r}")
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0, got rows={rows}, cols={cols}")
    offset = dropout.k_offset if dropout.position == "pre" else 0
    return _draw(dropout.seed, dropout.p, rows, cols, offset, device, uniform=False).view(torch.bool)


def kernel_uniforms(
    seed: int | torch.Tensor, rows: int, cols: int, col_offset: int, device: torch.device | str, salt: int = 0
) -> torch.Tensor:
    """The kernels' fp32 uniforms ``u(m, col_offset + c)``, ``[rows, cols]``, for ``seed`` (an int, or a ``[1]``
    int64 tensor on ``device`` plus the scalar ``salt``), to check the eager ``parallel_lora._dropout.hash_uniform``
    bit for bit."""
    return _draw(seed, 0.0, rows, cols, col_offset, device, uniform=True, salt=salt)
