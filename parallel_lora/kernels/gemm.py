"""The GEMM with the rank-r term in its fp32 accumulator, for y (``w = W^T``, ``s = S``, ``f = B^T``) and dx
(``w = W``, ``s = G``, ``f = A``): ``out = x @ w (+ bias) + c * drop(s @ f)``; the portable pointer kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import as_operand
from .dropout_mask import drop_tile, mask_keys
from .gemm_tma import GEMM_KEY, MAX_BLOCK_R, describe_tma_gemm, gemm_fits, gemm_work, tma_compatible, tma_operand
from .host import cdiv, dot_options, keep_scale, pad_rank, seed_arg
from .launcher import Site, launch, output
from .spec import KernelSpec, adapter_bytes


def gemm_configs() -> list[triton.Config]:
    """The pointer GEMM's configs (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): Triton's matmul tutorial's."""
    rows = [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 64, 32, 5, 2),
        (64, 64, 32, 2, 4),  # the fallback that fits ~100 KB even for fp32 at r = 256
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in rows
    ]


def gemm_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The rank tiles take one buffer, or ``stages`` when the rank takes several chunks (a pipelined loop).
    bm, bn, bk, br = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], consts["BLOCK_R"]
    rank_buffers = stages if consts["R"] > br else 1
    rank = adapter_bytes(bn * br, rank_buffers, elem, consts, "f_ptr")
    return (stages * (bm * bk + bk * bn) + rank_buffers * bm * br) * elem + rank


@triton.jit(do_not_specialize=["seed_salt", "n_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    s_ptr,
    f_ptr,
    out_ptr,
    M,
    N_OUT,
    K_RED,
    R,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_sm,
    stride_sr,
    stride_fr,
    stride_fn,
    stride_om,
    stride_on,
    stride_bias,
    keep_scale,
    p,
    seed_ptr,
    seed_salt: tl.int64,
    n_offset,
    HAS_BIAS: tl.constexpr,
    LORA_DROP: tl.constexpr,
    ODD_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out [M, N_OUT] = x [M, K_RED] @ w [K_RED, N_OUT] (+ bias) + drop(s [M, R] @ f [R, N_OUT])``, any strides;
    under ``LORA_DROP`` the rank term is masked at global columns ``n_offset + n`` and scaled by ``keep_scale``."""
    # Not blocks.tile_coords / rank_term: this kernel's rank loop runs over R at run time.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N_OUT
    rows64 = offs_m[:, None].to(tl.int64)  # M * stride can pass 2**31

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # one fp32 accumulator for base + LoRA

    # Rank-r term first, so its mask (dx under "pre" dropout) touches the LoRA term only.
    offs_r = tl.arange(0, BLOCK_R)
    s_ptrs = s_ptr + rows64 * stride_sm + offs_r[None, :] * stride_sr
    f_ptrs = f_ptr + offs_r[:, None] * stride_fr + offs_n[None, :] * stride_fn
    for r0 in range(0, R, BLOCK_R):
        r_in = offs_r < R - r0
        s = tl.load(s_ptrs, mask=m_in[:, None] & r_in[None, :], other=0.0)
        f = as_operand(tl.load(f_ptrs, mask=r_in[:, None] & n_in[None, :], other=0.0), s.dtype, UPCAST)
        if UPCAST:
            s = s.to(tl.float32)
            f = f.to(tl.float32)
        acc = tl.dot(s, f, acc, input_precision=DOT_PRECISION)
        s_ptrs += BLOCK_R * stride_sr
        f_ptrs += BLOCK_R * stride_fr
    if LORA_DROP:
        k_row, k_col = mask_keys(seed_ptr, seed_salt, LORA_DROP)
        acc = drop_tile(acc * keep_scale, k_row, k_col, p, offs_m, n_offset + pid_n * BLOCK_N, ODD_OFFSET)

    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows64 * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    for k0 in range(0, K_RED, BLOCK_K):
        k_in = offs_k < K_RED - k0
        a = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=n_in, other=0.0)
        acc += bias[None, :].to(tl.float32)

    out_ptrs = out_ptr + rows64 * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


SPEC = KernelSpec(
    name="gemm",
    configs=gemm_configs,
    key=GEMM_KEY,
    smem=gemm_smem,
    work=gemm_work,
    fits=gemm_fits,
    dtype_arg="x_ptr",
    interp={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4},
)


def lora_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    f: torch.Tensor,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    n_offset: int = 0,
    lora_drop: bool = False,
    site: Site | None = None,
) -> torch.Tensor:
    """``x [M, K_red] @ w [K_red, N_out] (+ bias) + drop(s [M, r] @ f [r, N_out])`` in ``x.dtype``, any strides;
    ``drop`` (with ``lora_drop``): the "pre" mask of columns ``n_offset + n``, times ``1/(1-p)``."""
    M = x.shape[0]
    N_out = w.shape[1]
    out = output(x, M, N_out)
    if M == 0 or N_out == 0:
        return out
    # The TMA kernel may read w as w.t(): the same address, and a launch reads only addresses.
    tensors = (x, w, bias if bias is not None else out, s, f, out)
    runtime = (keep_scale(p, lora_drop), float(p), *seed_arg(seed, x), int(n_offset))
    launch(site, tensors, runtime, _describe, x, w, bias, s, f, out, lora_drop, n_offset)
    return out


def _describe(x, w, bias, s, f, out, lora_drop: bool, n_offset: int) -> tuple:
    """The launch of ``lora_gemm`` for this layout: the TMA kernel where the operands allow, else this one."""
    odd = lora_drop and n_offset % 2 == 1
    w_tma, w_nk = tma_operand(w)
    if tma_compatible(x, w_tma, out.shape[1]):
        return describe_tma_gemm(x, w_tma, w_nk, bias, s, f, out, lora_drop, odd)
    M, K_red = x.shape
    N_out, R = out.shape[1], s.shape[1]

    def build():
        static = (M, N_out, K_red, R, *x.stride(), *w.stride(), *s.stride(), *f.stride(), *out.stride(),
                  bias.stride(0) if bias is not None else 0)  # fmt: skip
        consts = {
            "HAS_BIAS": bias is not None,
            "LORA_DROP": lora_drop,
            "ODD_OFFSET": odd,
            "BLOCK_R": min(pad_rank(R), MAX_BLOCK_R),
            **dot_options(x.dtype),
        }
        return static, lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N_out, meta["BLOCK_N"]),), consts

    signature = (x.shape, x.stride(), w.shape, w.stride(), None if bias is None else bias.stride(), s.shape,
                 s.stride(), f.stride(), x.dtype, f.dtype, lora_drop, odd)  # fmt: skip
    return SPEC, _lora_gemm_kernel, signature, build
