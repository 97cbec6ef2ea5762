"""Adapter gradients as deterministic reductions over M:

    out[F, r] = c * drop(feat)^T @ g        feat [M, F], g [M, r]

    dA = G^T drop_pre(x)   [r, K]:   feat = x  [M, K], g = G [M, r], c = 1/(1-p) under "pre" (mask on x)
    dB = dy^T S            [N, r]:   feat = dy [M, N], g = S [M, r], c = 1

(dA is written through transposed output strides, so both land in their natural layout.) A program owns
``BLOCK_F`` feature columns and the whole padded rank, ``acc [BLOCK_F, R_PAD]`` (fp32), and walks one
contiguous chunk of ``m_per_split`` rows in ``BLOCK_M`` steps, ``acc += feat_tile^T @ g_tile`` (the feat
tile is loaded transposed). With one split it stores the result; with several, each split stores an fp32
partial ``[split, F, r]`` and the launcher sums them in a fixed order: deterministic, no atomics. The
split count depends only on the shape (never on the tuned config), and every split length is a multiple
of every config's ``BLOCK_M``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import dot_options, interpreting, pad_rank, split_seed
from .configs import (
    REDUCE_M_ALIGN_GPU,
    REDUCE_M_ALIGN_INTERP,
    KernelSpec,
    launch,
    reduce_configs,
    reduce_fits,
    reduce_smem,
)
from .dropout_mask import keep_tile


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "f_offset"])
def _lora_rank_reduce_kernel(
    # pointers
    feat_ptr,  # [M, F]  (x, or dy)
    g_ptr,  # [M, R]     (G, or S)
    out_ptr,  # [split, F, R] through strides
    # sizes
    M,
    F,
    R,
    m_per_split,
    # strides
    stride_fm,
    stride_ff,
    stride_gm,
    stride_gr,
    stride_os,
    stride_of,
    stride_or,
    # runtime scalars (changing them never recompiles)
    out_scale,
    p,
    seed_lo,
    seed_hi,
    f_offset,  # global column of feat's first column (the shard's k_offset), for the "pre" mask
    # compile-time
    DROP_FEAT: tl.constexpr,
    R_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_f = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    offs_mb = tl.arange(0, BLOCK_M)
    f_in = offs_f < F
    r_in = offs_r < R
    m_start = pid_s * m_per_split
    m_end = tl.minimum(m_start + m_per_split, M)

    rows64 = (m_start + offs_mb).to(tl.int64)  # M * stride can pass 2**31
    ft_ptrs = feat_ptr + offs_f[:, None] * stride_ff + rows64[None, :] * stride_fm  # transposed [BF, BM]
    g_ptrs = g_ptr + rows64[:, None] * stride_gm + offs_r[None, :] * stride_gr

    acc = tl.zeros((BLOCK_F, R_PAD), dtype=tl.float32)  # fp32 accumulator for every input dtype
    for m0 in range(m_start, m_end, BLOCK_M):
        offs_m = m0 + offs_mb
        m_in = offs_m < m_end
        ft = tl.load(ft_ptrs, mask=f_in[:, None] & m_in[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=m_in[:, None] & r_in[None, :], other=0.0)
        if DROP_FEAT:
            keep = keep_tile(seed_lo, seed_hi, p, offs_m[None, :], f_offset + offs_f[:, None])
            ft = tl.where(keep, ft, tl.zeros_like(ft))
        if UPCAST:
            ft = ft.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(ft, g, acc, input_precision=DOT_PRECISION)
        ft_ptrs += BLOCK_M * stride_fm
        g_ptrs += BLOCK_M * stride_gm
    acc = acc * out_scale

    out_ptrs = out_ptr + pid_s * stride_os + offs_f[:, None] * stride_of + offs_r[None, :] * stride_or
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=f_in[:, None] & r_in[None, :])


_SPEC = KernelSpec(
    name="reduce",
    configs=reduce_configs,
    key=("M", "F", "R"),
    smem=reduce_smem,
    work=lambda n: n["M"] * n["F"] * n["R"],
    fits=reduce_fits,
    dtype_arg="feat_ptr",
)


def _num_programs_target(device: torch.device) -> int:
    if interpreting():
        return 4  # small, so that test-sized problems exercise the multi-split path
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_rows(M: int, F: int, device: torch.device) -> tuple[int, int]:
    """``(split, m_per_split)`` for the M reduction: enough programs to fill the device when ``F / BLOCK_F``
    alone would not, each chunk a multiple of ``BLOCK_M``. A function of the shape only, so repeated calls
    reduce in the same order (bitwise reproducible)."""
    align = REDUCE_M_ALIGN_INTERP if interpreting() else REDUCE_M_ALIGN_GPU
    f_tiles = triton.cdiv(F, 32 if interpreting() else 128)
    max_split = triton.cdiv(M, align)
    split = max(1, min(max_split, _num_programs_target(device) // max(1, f_tiles)))
    m_per_split = triton.cdiv(triton.cdiv(M, split), align) * align
    return triton.cdiv(M, m_per_split), m_per_split


def lora_rank_reduce(
    feat: torch.Tensor,
    g: torch.Tensor,
    *,
    transpose_out: bool,
    p: float = 0.0,
    seed: int = 0,
    f_offset: int = 0,
    drop_feat: bool = False,
) -> torch.Tensor:
    """``c * drop(feat [M, F])^T @ g [M, r]`` as ``[F, r]``, or ``[r, F]`` when ``transpose_out``, in
    ``feat.dtype``; ``c = 1/(1-p)`` with ``drop_feat`` (the "pre" mask of ``feat``'s columns shifted by
    ``f_offset``), else 1. ``M == 0`` gives zeros. Inputs are assumed checked by the caller."""
    M, F = feat.shape
    R = g.shape[1]
    shape = (R, F) if transpose_out else (F, R)
    if M == 0 or F == 0:
        return torch.zeros(shape, device=feat.device, dtype=feat.dtype)
    split, m_per_split = split_rows(M, F, feat.device)
    if split == 1:
        out = torch.empty(shape, device=feat.device, dtype=feat.dtype)
        ws = out.unsqueeze(0)
    else:
        ws = torch.empty((split, *shape), device=feat.device, dtype=torch.float32)
    # Strides of the output seen as [split, F, R].
    stride_of, stride_or = (ws.stride(2), ws.stride(1)) if transpose_out else (ws.stride(1), ws.stride(2))
    seed_lo, seed_hi = split_seed(seed)
    c = 1.0 / (1.0 - p) if drop_feat else 1.0
    args = (
        feat, g, ws, M, F, R, m_per_split,
        feat.stride(0), feat.stride(1), g.stride(0), g.stride(1), ws.stride(0), stride_of, stride_or,
        float(c), float(p), seed_lo, seed_hi, int(f_offset),
    )  # fmt: skip
    consts = {"DROP_FEAT": drop_feat, "R_PAD": pad_rank(R), **dot_options(feat.dtype)}

    def grid(meta):
        return (triton.cdiv(F, meta["BLOCK_F"]), split)

    launch(_SPEC, _lora_rank_reduce_kernel, grid, args, consts)
    if split == 1:
        return out
    return ws.sum(0).to(feat.dtype)
