"""The dropout keep-mask as the kernels draw it, plus a tiny kernel that materializes it for tests.

Element ``(m, c)`` of a dropped tensor is kept iff ``u(m, c) >= p`` with

    u(m, c) = uint_to_uniform_float(philox_4x32_10(key=seed, counter=(c, m, 0, 0))[0])

where ``c`` is the *global* column (``k_offset + k`` for "pre" on ``x [M, K]``, ``j`` in ``[0, r)`` for
"post" on ``x A^T [M, r]``). This is the stream of ``parallel_lora.dropout.philox_uniform`` (the eager
path), bit for bit. Masks are never stored: each kernel that needs one regenerates its tile from the seed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dropout import Dropout
from ._interp import split_seed


@triton.jit
def philox_uniform_tile(seed_lo, seed_hi, rows, cols):
    """Uniform fp32 in [0, 1) for the broadcast tile of ``rows`` (column vector) x ``cols`` (row vector)."""
    # The key travels as two int32 halves (one compiled variant for every seed); reassemble the uint64.
    hi = seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64)
    lo = seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    seed = (hi << 32) | lo
    zero = rows * 0 + cols * 0
    c0 = (cols + zero).to(tl.uint32)
    c1 = (rows + zero).to(tl.uint32)
    z = zero.to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, c0, c1, z, z)
    return tl.uint_to_uniform_float(r0)


@triton.jit
def keep_tile(seed_lo, seed_hi, p, rows, cols):
    """Boolean keep-mask tile: ``u(rows, cols) >= p``."""
    return philox_uniform_tile(seed_lo, seed_hi, rows, cols) >= p


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "col_offset"])
def _lora_dropout_mask_kernel(
    out_ptr,  # [rows, cols] uint8 keep-mask, or fp32 uniforms when WRITE_UNIFORM
    rows,
    cols,
    stride_om,
    stride_oc,
    p,
    seed_lo,
    seed_hi,
    col_offset,
    WRITE_UNIFORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    u = philox_uniform_tile(seed_lo, seed_hi, offs_m[:, None], col_offset + offs_c[None, :])
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_c[None, :] * stride_oc
    in_bounds = (offs_m[:, None] < rows) & (offs_c[None, :] < cols)
    if WRITE_UNIFORM:
        tl.store(ptrs, u, mask=in_bounds)
    else:
        tl.store(ptrs, (u >= p).to(tl.uint8), mask=in_bounds)


def _draw(seed: int, p: float, rows: int, cols: int, col_offset: int, device, uniform: bool) -> torch.Tensor:
    out = torch.empty(rows, cols, device=device, dtype=torch.float32 if uniform else torch.uint8)
    if rows == 0 or cols == 0:
        return out
    seed_lo, seed_hi = split_seed(seed)
    grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 32))
    _lora_dropout_mask_kernel[grid](
        out, rows, cols, out.stride(0), out.stride(1), float(p), seed_lo, seed_hi, int(col_offset),
        WRITE_UNIFORM=uniform, BLOCK_M=32, BLOCK_C=32,
    )  # fmt: skip
    return out


def dropout_keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """The ``[rows, cols]`` boolean keep-mask the kernels apply for ``dropout`` (columns shifted by
    ``k_offset`` for "pre"); equals ``parallel_lora.dropout.keep_mask``. For tests and debugging."""
    if dropout.position not in ("pre", "post"):
        raise ValueError(f"dropout.position must be 'pre' or 'post', got {dropout.position!r}")
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0, got rows={rows}, cols={cols}")
    offset = dropout.k_offset if dropout.position == "pre" else 0
    return _draw(dropout.seed, dropout.p, rows, cols, offset, device, uniform=False).view(torch.bool)


def philox_uniform(seed: int, rows: int, cols: int, col_offset: int, device) -> torch.Tensor:
    """The kernels' fp32 uniforms ``u(m, col_offset + c)`` (to check the eager transcription bit for bit)."""
    return _draw(seed, 0.0, rows, cols, col_offset, device, uniform=True)
