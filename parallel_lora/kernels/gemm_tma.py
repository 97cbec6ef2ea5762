"""The persistent, TMA-fed LoRA GEMM (Hopper or newer, 16-bit): ``gemm``'s function,
``out [M, N_out] = x [M, K_red] @ w (+ bias) + c * drop(s [M, r] @ f [r, N_out])``, and the configs every GEMM shares.
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

GEMM_KEY = ("M", "N_OUT", "K_RED", "R")
MAX_BLOCK_R = 64  # r = 256 in one chunk would double a 128 x 128 tile's shared memory


def gemm_work(n: dict) -> int:
    return n["M"] * n["N_OUT"] * (n["K_RED"] + n["R"])


def gemm_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_M"] <= max(64, next_pow2(nargs["M"])) and cfg["BLOCK_N"] <= max(64, next_pow2(nargs["N_OUT"]))


def tma_configs() -> list[triton.Config]:
    """The TMA GEMM's configs, rows of (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)."""
    rows = [
        (128, 256, 64, 3, 8),  # on par with cuBLAS at 8192 x 4096 -> 4096 (H200)
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (64, 64, 64, 3, 4),  # fits ~100 KB (sm_120-class parts have TMA but less smem)
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in rows
    ]


def tma_configs_with(name: str, values: Sequence[int]) -> list[triton.Config]:
    """``tma_configs``, each row with ``name`` set to the matching value (a fused launch's spare-program tile)."""
    return [
        triton.Config({**c.kwargs, name: v}, num_stages=c.num_stages, num_warps=c.num_warps)
        for c, v in zip(tma_configs(), values, strict=True)
    ]


def tma_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The rank tiles' dot operands in the compute dtype: an fp32 adapter tile, loaded outside the K loop, stays in
    # registers until rounded (RANK_TMA, which stages it, takes 16-bit adapters only).
    bm, bn, bk, br = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], consts["BLOCK_R"]
    rank_barriers = 16 if consts.get("RANK_TMA") else 0
    return (stages * (bm + bn) * bk + bm * bn // 2 + (bm + bn) * br) * elem + stages * 8 + rank_barriers


# fmt: off


@triton.jit(do_not_specialize=["seed_salt", "n_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_gemm_tma_kernel(
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
    stride_w,
    stride_sm,
    stride_sr,
    stride_fr,
    stride_fn,
    stride_om,
    stride_bias,
    keep_scale,
    p,
    seed_ptr,
    seed_salt: tl.int64,
    n_offset,
    W_NK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LORA_DROP: tl.constexpr,
    ODD_OFFSET: tl.constexpr,
    RANK_TMA: tl.constexpr,
    F_T: tl.constexpr,
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
    """``gemm._lora_gemm_kernel``'s arguments; x, w (``[N_OUT, K_RED]`` with ``W_NK``) and out have unit inner
    stride, and ``NUM_SMS`` programs walk the tiles (``blocks.gemm_tiles``)."""
    k_row, k_col = mask_keys(seed_ptr, seed_salt, LORA_DROP)
    gemm_tiles(
        x_ptr, w_ptr, bias_ptr, s_ptr, f_ptr, out_ptr, M, N_OUT, K_RED, R,
        stride_xm, stride_w, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
        keep_scale, p, k_row, k_col, n_offset, tl.program_id(0), NUM_SMS,
        W_NK, HAS_BIAS, LORA_DROP, ODD_OFFSET, RANK_TMA, F_T, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M,
    )


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

_TMA_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _device_has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_rows(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read the 2-D ``t``: 16-bit, on Hopper or newer (or interpreted), unit inner
    stride, 16-byte aligned base and rows."""
    if t.dtype not in _TMA_DTYPES:
        return False
    if not interpreting() and not (t.is_cuda and _device_has_tma(t.get_device())):
        return False
    row_stride, col_stride = t.stride()
    return col_stride == 1 and row_stride % 8 == 0 and t.data_ptr() % 16 == 0  # 8 16-bit elements = 16 B


def tma_operand(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(w, False)``, or ``(w.t(), True)`` when ``w [K_red, N_out]``'s transpose has the unit inner stride."""
    w_nk = w.stride(0) == 1 and w.stride(1) != 1
    return (w.t() if w_nk else w), w_nk


def rank_tma(s: torch.Tensor, f: torch.Tensor, lora_drop: bool) -> dict[str, bool]:
    """``RANK_TMA`` (the rank tiles of ``s [M, r] @ f [r, N_out]`` through TMA descriptors) and ``F_T`` (f read as
    ``f.t()``'s rows) for a TMA GEMM launch; docs/kernels.md says when."""
    describable = not lora_drop and pad_rank(s.shape[1]) <= MAX_BLOCK_R and tma_rows(s)
    if describable and tma_rows(f):
        return {"RANK_TMA": True, "F_T": False}
    if describable and tma_rows(f.t()):
        return {"RANK_TMA": True, "F_T": True}
    return {"RANK_TMA": False, "F_T": False}


def tma_compatible(x: torch.Tensor, w: torch.Tensor, out_cols: int) -> bool:
    """Whether ``x [M, K_red]``, ``w`` and an output of ``out_cols`` columns can go through the TMA GEMM."""
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
    """The TMA kernel's launch (``launcher.launch``'s ``describe``) for ``gemm.lora_gemm``'s operands and
    runtime scalars; ``w`` is read transposed when ``w_nk``."""
    M, K_red = x.shape
    N_out = out.shape[1]
    R = s.shape[1]
    num_sms = 2 if interpreting() else sm_count(x.device.index or 0)

    def build():
        static = (M, N_out, K_red, R, x.stride(0), w.stride(0), *s.stride(), *f.stride(), out.stride(0),
                  bias.stride(0) if bias is not None else 0)
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
                 s.stride(), f.stride(), x.dtype, f.dtype, lora_drop, odd_offset, num_sms)
    return SPEC, _lora_gemm_tma_kernel, signature, build
