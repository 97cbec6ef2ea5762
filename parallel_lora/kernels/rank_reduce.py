"""Adapter gradients as deterministic reductions over M:

    out[F, r] = c * drop(feat)^T @ g        feat [M, F], g [M, r]

    dA = G^T drop_pre(x)   [r, K]:   feat = x  [M, K], g = G [M, r], c = 1/(1-p) under "pre" (mask on x)
    dB = dy^T S            [N, r]:   feat = dy [M, N], g = S [M, r], c = 1

(dA is written through transposed output strides, so both land in their natural layout.) A program owns
``BLOCK_F`` feature columns and the whole padded rank, ``acc [R_PAD, BLOCK_F]`` (fp32), and walks one
contiguous chunk of ``m_per_split`` rows in ``BLOCK_M`` steps, ``acc += g_tile^T @ feat_tile``: the big
operand stays in its row-major layout, through a TMA descriptor where its rows allow (16-bit, Hopper), else
through pointers. With one split it stores the result; with several, each split stores an fp32 partial
``[split, F, r]`` and the launcher sums them in a fixed order: deterministic, no atomics. The split count
depends only on the shape (never on the tuned config), and every split length is a multiple of every
config's ``BLOCK_M``.

This form runs at about 2.5 TB/s on the H200 at M, F = 8192, 4096 (3.3 TB/s at F = 14336) against
1.3 TB/s for the earlier ``feat^T [F, M] @ g`` form (``benchmarks/probe_gemm.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import cdiv, dot_options, interpreting, pad_rank, split_seed
from .configs import (
    REDUCE_M_ALIGN_GPU,
    REDUCE_M_ALIGN_INTERP,
    KernelSpec,
    launch,
    reduce_configs,
    reduce_fits,
    reduce_smem,
    sm_count,
)
from .dropout_mask import keep_tile
from .gemm_tma import ensure_allocator, tma_rows


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
    FEAT_TMA: tl.constexpr,
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
    if FEAT_TMA:
        # Rows past M come back as zeros; a split ends on a BLOCK_M boundary, so no tile crosses into the
        # next split.
        feat_desc = tl.make_tensor_descriptor(feat_ptr, [M, F], [stride_fm, 1], [BLOCK_M, BLOCK_F])

    # acc^T [R_PAD, BLOCK_F] = g^T [R_PAD, BLOCK_M] @ feat [BLOCK_M, BLOCK_F]: the big operand is read in
    # its natural row-major layout (the transposed [F, M] form ran at half the bandwidth).
    acc = tl.zeros((R_PAD, BLOCK_F), dtype=tl.float32)
    for m0 in tl.range(m_start, m_end, BLOCK_M):
        offs_m = m0 + offs_mb
        m_in = offs_m < m_end
        rows64 = offs_m.to(tl.int64)  # M * stride can pass 2**31
        if FEAT_TMA:
            ft = feat_desc.load([m0, pid_f * BLOCK_F])
        else:
            ft = tl.load(
                feat_ptr + rows64[:, None] * stride_fm + offs_f[None, :] * stride_ff,
                mask=m_in[:, None] & f_in[None, :],
                other=0.0,
            )
        gt = tl.load(
            g_ptr + rows64[None, :] * stride_gm + offs_r[:, None] * stride_gr,
            mask=r_in[:, None] & m_in[None, :],
            other=0.0,
        )
        if DROP_FEAT:
            keep = keep_tile(seed_lo, seed_hi, p, offs_m[:, None], f_offset + offs_f[None, :])
            ft = tl.where(keep, ft, tl.zeros_like(ft))
        if UPCAST:
            ft = ft.to(tl.float32)
            gt = gt.to(tl.float32)
        acc = tl.dot(gt, ft, acc, input_precision=DOT_PRECISION)
    acc = acc * out_scale

    out_ptrs = out_ptr + pid_s * stride_os + offs_r[:, None] * stride_or + offs_f[None, :] * stride_of
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_in[:, None] & f_in[None, :])


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
    return 2 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Below this many feat elements (32 MiB of bf16, ~13 us of reading at 2.5 TB/s) one split reads the whole
# reduction in about the time the partials' extra sum and cast launches cost on the host (15-25 us each
# on autograd's device thread, H200 machine): short sequences then take one launch per gradient.
SPLIT_MIN_ELEMS = 2**24


def split_rows(M: int, F: int, device: torch.device) -> tuple[int, int]:
    """``(split, m_per_split)`` for the M reduction: enough programs to fill the device when ``F / BLOCK_F``
    alone would not (on GPU only from ``SPLIT_MIN_ELEMS`` up), each chunk a multiple of ``BLOCK_M``. A
    function of the shape only, so repeated calls reduce in the same order (bitwise reproducible)."""
    align = REDUCE_M_ALIGN_INTERP if interpreting() else REDUCE_M_ALIGN_GPU
    if not interpreting() and M * F < SPLIT_MIN_ELEMS:
        split = 1
    else:
        f_tiles = cdiv(F, 32 if interpreting() else 128)
        split = max(1, min(cdiv(M, align), _num_programs_target(device) // max(1, f_tiles)))
    m_per_split = cdiv(cdiv(M, split), align) * align
    return cdiv(M, m_per_split), m_per_split


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
    feat_tma = tma_rows(feat)
    if feat_tma and not interpreting():
        ensure_allocator()
    consts = {"DROP_FEAT": drop_feat, "FEAT_TMA": feat_tma, "R_PAD": pad_rank(R), **dot_options(feat.dtype)}

    def grid(meta):
        return (cdiv(F, meta["BLOCK_F"]), split)

    launch(_SPEC, _lora_rank_reduce_kernel, grid, args, consts)
    if split == 1:
        return out
    return ws.sum(0).to(feat.dtype)
