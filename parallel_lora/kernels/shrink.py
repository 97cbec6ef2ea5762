"""Rank-r shrink: ``out[M, r] = c * drop_post(drop_pre(x) @ U)`` for ``x [M, K]``, ``U [K, r]``.

Used twice per step:

    forward   S = s * drop_post(drop_pre(x) A^T)     x [M, K],  U = A^T [K, r]
    backward  G = s * drop_post(dy B)                 dy [M, N], U = B   [N, r]

One program owns ``BLOCK_M`` rows and the whole (padded) rank: ``acc [BLOCK_M, R_PAD]`` (fp32) runs over K in
``BLOCK_K`` steps, ``acc += drop_pre(x_tile) @ U_tile``. Dropout scales every kept element by the same
``1/(1-p)``, so the kernel only *zeroes* dropped elements (exact in any dtype) and folds ``1/(1-p)`` into the
scalar ``c = s/(1-p)`` applied once to the fp32 accumulator; the result is rounded to the input dtype once.
The rank tail ``r < R_PAD`` is masked on load and store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import cdiv, dot_options, pad_rank, split_seed
from .configs import KernelSpec, Site, launch, shrink_configs, shrink_fits, shrink_smem
from .dropout_mask import drop_tile


@triton.jit
def shrink_rows(
    x_ptr, u_ptr, row0, M, K, R, stride_xm, stride_xk, stride_uk, stride_ur, out_scale, p, seed_lo, seed_hi,
    k_offset, DROP_PRE: tl.constexpr, ODD_OFFSET: tl.constexpr, DROP_POST: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, X_TMA: tl.constexpr,
):  # fmt: skip
    """``out_scale * drop_post(drop_pre(x[row0 : row0 + BLOCK_M]) @ U)`` as an fp32 ``[BLOCK_M, R_PAD]`` tile, K in
    ``BLOCK_K`` steps pipelined in ``STAGES`` stages (None: the launch's ``num_stages``). ``ODD_OFFSET``: the
    "pre" mask's ``k_offset`` is odd (``dropout_mask.drop_tile``). ``X_TMA``: x's tiles
    through a TMA descriptor (unit inner stride, 16-byte rows; zeros past M and K, as the masked loads give), as
    the fused forward's producers read them. The masked pointer loads pipeline too once the strides specialize
    on 16, as on a GPU launch (``benchmarks/compile_check.py``); the standalone launch through TMA was no faster
    on the H200 (28.6 against 28.0 us at 8192 x 4096, benchmarks/NOTES.md, session 13)."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    m_in = offs_m < M
    r_in = offs_r < R
    # int64 rows: M * stride_xm can pass 2**31 for long sequences.
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    u_ptrs = u_ptr + offs_k[:, None] * stride_uk + offs_r[None, :] * stride_ur

    if X_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])

    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)  # fp32 accumulator for every input dtype
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_in = offs_k < K - k0
        if X_TMA:
            x = x_desc.load([row0, k0])
        else:
            x = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_in[:, None] & r_in[None, :], other=0.0)
        if DROP_PRE:
            x = drop_tile(x, seed_lo, seed_hi, p, offs_m, k_offset + k0, ODD_OFFSET)
        if UPCAST:
            x = x.to(tl.float32)
            u = u.to(tl.float32)
        acc = tl.dot(x, u, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        u_ptrs += BLOCK_K * stride_uk

    if DROP_POST:
        acc = drop_tile(acc, seed_lo, seed_hi, p, offs_m, 0, False)
    return acc * out_scale


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "k_offset"])
def _lora_shrink_kernel(
    # pointers
    x_ptr,  # [M, K]
    u_ptr,  # [K, R]
    out_ptr,  # [M, R]
    # sizes
    M,
    K,
    R,
    # strides
    stride_xm,
    stride_xk,
    stride_uk,
    stride_ur,
    stride_om,
    stride_or,
    # runtime scalars (changing them never recompiles)
    out_scale,  # s, times 1/(1-p) when this kernel applies the dropout
    p,
    seed_lo,
    seed_hi,
    k_offset,  # global column of x's first column (the shard's offset), for the "pre" mask
    # compile-time
    DROP_PRE: tl.constexpr,
    ODD_OFFSET: tl.constexpr,  # k_offset is odd
    DROP_POST: tl.constexpr,
    R_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    acc = shrink_rows(
        x_ptr, u_ptr, row0, M, K, R, stride_xm, stride_xk, stride_uk, stride_ur, out_scale, p, seed_lo, seed_hi,
        k_offset, DROP_PRE, ODD_OFFSET, DROP_POST, R_PAD, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_K, None, False,
    )  # fmt: skip
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :] * stride_or
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))


_SPEC = KernelSpec(
    name="shrink",
    configs=shrink_configs,
    key=("M", "K", "R"),
    smem=shrink_smem,
    work=lambda n: n["M"] * n["K"] * n["R"],
    fits=shrink_fits,
    dtype_arg="x_ptr",
)


def shrink_scale(scale: float, p: float, masked: bool) -> float:
    """The factor ``c`` of ``S = c * drop(...)``: dropout zeroes the dropped elements and the kept ones are scaled
    by ``1/(1-p)``, folded here into ``scale`` once (``masked``: a mask is applied by this launch)."""
    return scale / (1.0 - p) if masked else scale


def lora_shrink(
    x: torch.Tensor,
    u: torch.Tensor,
    scale: float,
    *,
    p: float = 0.0,
    seed: int = 0,
    k_offset: int = 0,
    drop_pre: bool = False,
    drop_post: bool = False,
    site: Site | None = None,
) -> torch.Tensor:
    """``x [M, K]``, ``u [K, r]`` (any strides, e.g. ``A.t()``) -> ``c * drop_post(drop_pre(x) @ u) [M, r]``
    in ``x.dtype``, with ``c = scale / (1 - p)`` if a mask is applied here, else ``scale``. Inputs are
    assumed checked by the caller (``parallel_lora.kernels.lora``), which passes a ``site`` bound to this
    operand layout (filled here at the layout's first call)."""
    M = x.shape[0]
    R = u.shape[1]
    out = torch.empty(M, R, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    c = shrink_scale(scale, p, drop_pre or drop_post)
    seed_lo, seed_hi = split_seed(seed)
    runtime = (float(c), float(p), seed_lo, seed_hi, int(k_offset))
    if site is not None and site.bound is not None:
        site.bound.launch((x, u, out), runtime)
        return out
    K = x.shape[1]
    odd = drop_pre and k_offset % 2 == 1

    def build():
        static = (M, K, R, *x.stride(), *u.stride(), *out.stride())
        consts = {"DROP_PRE": drop_pre, "ODD_OFFSET": odd, "DROP_POST": drop_post, "R_PAD": pad_rank(R),
                  **dot_options(x.dtype)}  # fmt: skip
        return static, lambda meta: (cdiv(M, meta["BLOCK_M"]),), consts

    signature = (x.shape, x.stride(), u.shape, u.stride(), x.dtype, drop_pre, odd, drop_post)
    bound = launch(_SPEC, _lora_shrink_kernel, signature, (x, u, out), runtime, build)
    if site is not None:
        site.bound = bound
    return out
