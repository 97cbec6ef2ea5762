"""The Hopper path of the LoRA GEMM: a persistent, TMA-fed GEMM with the rank-r term in its epilogue.

    out[M, N_out] = x[M, K_red] @ w (+ bias) + c * drop(s[M, r] @ f[r, N_out])

    forward  y  = x  W^T + b + S B^T     w = W [N, K] read as [BLOCK_N, BLOCK_K] tiles (W_NK)
    backward dx = dy W + drop_pre(G A)   w = W [N, K] read as [BLOCK_K, BLOCK_N] tiles (the same W, no copy)

Same math and arguments as ``gemm._lora_gemm_kernel`` (the portable pointer kernel); what changes is how
the tiles move. ``NUM_SMS`` programs walk the output tiles in grouped order (``GROUP_M`` row-blocks sweep
the N tiles together, so the ``w`` panel stays in L2), and every x / w / out tile moves through a device-side
TMA descriptor (``tl.make_tensor_descriptor``): bulk copies into swizzled shared memory feeding wgmma, with
out-of-bounds rows and columns zero-filled on load and clipped on store, so M, N and K tails need no masks.
The output leaves as two half-width tiles (half the shared-memory staging). The tile loop is
``blocks.gemm_tiles``, which the backward's fused launch (``dx_grads``) runs too.

The rank-r term goes into the same fp32 accumulator, ``acc += s_tile @ f_tile`` (r in ``BLOCK_R`` chunks),
after the K loop; for dx under "pre" dropout it goes first, masked (columns ``n_offset + n``) and scaled by
``1/(1-p)``, and the K loop then accumulates onto it, so the mask touches the LoRA term alone without a
second accumulator tile.

Why this structure: flattening the tile and K loops (``tl.range(flatten=True)``) keeps a tile's first loads in
flight while the previous tile's epilogue runs, but only where the rank term's tiles come through TMA descriptors
too: read through pointers they stall the flattened pipeline (slower than unflattened loops, and slower still with
the rank term in the prologue), where unflattened loops with the half-tile store carry the rank term at the bare
GEMM's speed. So ``gemm_tiles`` flattens its loops wherever the rank tiles can be described (``rank_tma``; the rank
term then comes last), and keeps them apart otherwise.

Descriptors need 16-bit operands, unit inner strides and 16-byte aligned rows (``tma_compatible``); the
launcher (``gemm.lora_gemm``) sends everything else to the pointer kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .blocks import gemm_tiles
from .dropout_mask import mask_keys
from .host import cdiv, dot_options, interpreting, next_pow2, pad_rank
from .spec import KernelSpec
from .tuning import sm_count

# ---------------------------------------------------------------------------------------------------------
# Configs, shared by every GEMM launch (this one, the pointer kernel's and the fused launches').
# ---------------------------------------------------------------------------------------------------------

# Autotune key of every GEMM launch, and the rank chunk (r = 256 in one chunk would double the shared-memory
# footprint of a 128x128 tile).
GEMM_KEY = ("M", "N_OUT", "K_RED", "R")
MAX_BLOCK_R = 64


def gemm_work(n: dict) -> int:
    return n["M"] * n["N_OUT"] * (n["K_RED"] + n["R"])


def gemm_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_M"] <= max(64, next_pow2(nargs["M"])) and cfg["BLOCK_N"] <= max(64, next_pow2(nargs["N_OUT"]))


def tma_configs() -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). 128x256x64, 3 stages, 8 warps: on par with cuBLAS (H200,
    8192 x 4096 -> 4096); a 4th stage fits beside the rank tiles only with quarter-tile stores, no faster (H100)."""
    rows = [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (64, 64, 64, 3, 4),  # the fallback that fits ~100 KB (sm_120-class parts have TMA but less smem)
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in rows
    ]


def tma_configs_with(name: str, values: Sequence[int]) -> list[triton.Config]:
    """``tma_configs``, row by row, each with ``name``: a tile size of the work a fused launch's spare programs
    do (``dx_grads``, ``shrink_gemm``)."""
    return [
        triton.Config({**c.kwargs, name: v}, num_stages=c.num_stages, num_warps=c.num_warps)
        for c, v in zip(tma_configs(), values, strict=True)
    ]


def tma_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Per stage one x and one w tile and the 8-byte mbarrier its TMA loads arrive on; half the output tile is
    # staged in shared memory for its TMA store; the rank-r tiles of one chunk go through shared memory on their
    # way to the tensor cores (the barriers counted: the "pre"-dropout dx GEMM compiles 24 B past an estimate
    # without them, for sm_90a). Rank tiles through TMA (``RANK_TMA``, one chunk) add an mbarrier for each of
    # their two loads.
    bm, bn, bk, br = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], consts["BLOCK_R"]
    rank_barriers = 16 if consts.get("RANK_TMA") else 0
    return (stages * (bm + bn) * bk + bm * bn // 2 + (bm + bn) * br) * elem + stages * 8 + rank_barriers


# ---------------------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_gemm_tma_kernel(
    # pointers
    x_ptr,  # [M, K_RED]     activation (x, or dy), unit inner stride
    w_ptr,  # W [N_OUT, K_RED] when W_NK, else [K_RED, N_OUT]; unit inner stride
    bias_ptr,  # [N_OUT] or a dummy when not HAS_BIAS
    s_ptr,  # [M, R]         rank-r activation (S, or G)
    f_ptr,  # [R, N_OUT]     rank-r factor (B^T, or A)
    out_ptr,  # [M, N_OUT]   unit inner stride
    # sizes
    M,
    N_OUT,
    K_RED,
    R,
    # strides (inner strides are 1 for x, w, out)
    stride_xm,
    stride_w,
    stride_sm,
    stride_sr,
    stride_fr,
    stride_fn,
    stride_om,
    stride_bias,
    # runtime scalars (changing them never recompiles)
    keep_scale,
    p,
    seed_ptr,  # [1] int64, the call's seed (read under LORA_DROP only)
    n_offset,
    # compile-time
    W_NK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LORA_DROP: tl.constexpr,
    ODD_OFFSET: tl.constexpr,  # n_offset is odd
    RANK_TMA: tl.constexpr,  # the rank tiles through TMA, the loops flattened (``rank_tma``)
    F_T: tl.constexpr,  # f read as f^T's rows
    R_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_SMS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    k_row, k_col = mask_keys(seed_ptr, LORA_DROP)
    gemm_tiles(
        x_ptr, w_ptr, bias_ptr, s_ptr, f_ptr, out_ptr, M, N_OUT, K_RED, R,
        stride_xm, stride_w, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
        keep_scale, p, k_row, k_col, n_offset, tl.program_id(0), NUM_SMS,
        W_NK, HAS_BIAS, LORA_DROP, ODD_OFFSET, RANK_TMA, F_T, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M,
    )  # fmt: skip


SPEC = KernelSpec(
    name="gemm_tma",
    configs=tma_configs,
    key=GEMM_KEY,
    smem=tma_smem,
    work=gemm_work,
    fits=gemm_fits,
    dtype_arg="x_ptr",
    interp={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2},
    descriptors=lambda consts: True,
)

# ---------------------------------------------------------------------------------------------------------
# Which operands the TMA kernels take, and the launch.
# ---------------------------------------------------------------------------------------------------------

_TMA_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _device_has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_rows(t: torch.Tensor) -> bool:
    """Whether the 2-D operand ``t`` can be read through a TMA descriptor: a 16-bit dtype on a Hopper-or-newer
    GPU (or in the interpreter) with describable rows (unit inner stride, 16-byte aligned base and rows)."""
    if t.dtype not in _TMA_DTYPES:
        return False
    # Asked several times per layout: ``is_cuda`` / ``get_device()`` avoid building torch.device objects.
    if not interpreting() and not (t.is_cuda and _device_has_tma(t.get_device())):
        return False
    row_stride, col_stride = t.stride()
    return col_stride == 1 and row_stride % 8 == 0 and t.data_ptr() % 16 == 0  # 8 16-bit elements = 16 B


def tma_operand(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The frozen operand ``w [K_red, N_out]`` (W^T for y, W for dx) as the TMA GEMM reads it: ``(w, False)``, or
    ``(w.t(), True)`` (``W_NK``: tiles read transposed) when the transpose has the unit inner stride."""
    w_nk = w.stride(0) == 1 and w.stride(1) != 1
    return (w.t() if w_nk else w), w_nk


def rank_tma(s: torch.Tensor, f: torch.Tensor, lora_drop: bool) -> dict[str, bool]:
    """The launch constants ``RANK_TMA`` and ``F_T`` of a TMA GEMM's rank term ``s [M, r] @ f [r, N_out]``: whether
    its tiles can come through TMA descriptors (then ``gemm_tiles`` flattens its loops), and whether f is read as
    ``f.t()``'s rows (B [N, r] for y; A [r, K] for dx is read as is). Not under "pre" dropout, whose masked term
    goes first (a flattened loop with the rank term before the K loop is slow: see the module docstring); not for a
    rank whose rows are not 16-byte aligned (r = 4 in 16-bit); and not above one ``MAX_BLOCK_R`` chunk, where each
    chunk's tiles take shared memory of their own (past what a block may use at r = 128 on sm_90a). Those keep
    pointer loads."""
    describable = not lora_drop and pad_rank(s.shape[1]) <= MAX_BLOCK_R and tma_rows(s)
    if describable and tma_rows(f):
        return {"RANK_TMA": True, "F_T": False}
    if describable and tma_rows(f.t()):
        return {"RANK_TMA": True, "F_T": True}
    return {"RANK_TMA": False, "F_T": False}


def tma_compatible(x: torch.Tensor, w: torch.Tensor, out_cols: int) -> bool:
    """Whether ``x [M, K_red]`` and the frozen operand ``w`` (W, either orientation, as passed) can go through
    the TMA GEMM, with an output whose rows (``out_cols`` elements) are 16-byte aligned."""
    return tma_rows(x) and tma_rows(w) and (out_cols * x.element_size()) % 16 == 0


def describe_tma_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_nk: bool,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    f: torch.Tensor,
    out: torch.Tensor,
    lora_drop: bool,
    odd_offset: bool,
) -> tuple[KernelSpec, triton.runtime.jit.JITFunction, tuple, Callable[[], tuple]]:
    """The TMA kernel's launch (``launcher.launch``'s ``describe``) for ``out [M, N_out] = x @ (w.T if w_nk else
    w) (+ bias) + drop(s @ f)``; operands checked by ``tma_compatible`` and the caller (``gemm.lora_gemm``), whose
    pointer arguments and runtime scalars (``keep_scale, p, seed_ptr, n_offset``) it takes."""
    M, K_red = x.shape
    N_out = out.shape[1]
    R = s.shape[1]
    num_sms = 2 if interpreting() else sm_count(x.device.index or 0)

    def build():
        static = (M, N_out, K_red, R, x.stride(0), w.stride(0), *s.stride(), *f.stride(), out.stride(0),
                  bias.stride(0) if bias is not None else 0)  # fmt: skip
        r_pad = pad_rank(R)
        consts = {
            "W_NK": w_nk,
            "HAS_BIAS": bias is not None,
            "LORA_DROP": lora_drop,
            "ODD_OFFSET": odd_offset,
            **rank_tma(s, f, lora_drop),
            "R_PAD": r_pad,
            "BLOCK_R": min(r_pad, MAX_BLOCK_R),
            "NUM_SMS": num_sms,
            **dot_options(x.dtype),
        }

        def grid(meta):
            tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N_out, meta["BLOCK_N"])
            return (max(1, min(num_sms, tiles)),)

        return static, grid, consts

    signature = (x.shape, x.stride(), w.shape, w.stride(), w_nk, None if bias is None else bias.stride(), s.shape,
                 s.stride(), f.stride(), x.dtype, lora_drop, odd_offset, num_sms)  # fmt: skip
    return SPEC, _lora_gemm_tma_kernel, signature, build
