"""The rank-r shrink ``out [M, r] = c * drop_post(drop_pre(x [M, K]) @ U [K, r])``: S (``U = A^T``) in the forward,
G (``x = dy``, ``U = B``) in the backward; at few tokens K is split and the row block's last arrival sums the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import finish_tile, shrink_rows
from .dropout_mask import mask_keys
from .host import aligned_pieces, cdiv, dot_options, interpreting, next_pow2, pad_rank, seed_arg, shrink_scale
from .launcher import Site, launch, output, site_buffers, site_info
from .spec import KernelSpec, adapter_bytes
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import G_COUNTERS, G_PARTIALS, stream_buffer


def shrink_configs() -> list[triton.Config]:
    """The shrink's configs (BLOCK_M, BLOCK_K, stages, warps); the rank tile is R_PAD."""
    rows = [
        (32, 32, 2, 4),  # the fallback that fits ~100 KB even for fp32 at r = 256
        (16, 128, 4, 4),
        (16, 256, 3, 4),
        (32, 128, 4, 4),
        (32, 256, 3, 4),
        (32, 256, 4, 8),
        (64, 64, 4, 4),
        (64, 128, 3, 4),
        (64, 128, 4, 8),
        (128, 64, 3, 8),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_stages=s, num_warps=w) for bm, bk, s, w in rows]


def shrink_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Under the "pre" mask some Triton versions (3.8) stage the masked x tile in shared memory: counted. A split's
    # fp32 partial may be staged for its transposed store, after the loop.
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    staged = bm * bk if consts["DROP_PRE"] else 0
    loop = (stages * bm * bk + staged) * elem + adapter_bytes(bk * consts["R_PAD"], stages, elem, consts, "u_ptr")
    split = bm * consts["R_PAD"] * 4 + ATOMIC_SLOT if consts.get("SPLIT_K") else 0
    return max(loop, split)  # the K loop's buffers are free by the split's store


# K splits: whole BLOCK_K tiles of every config, so even (the "pre" mask's column parity).
K_ALIGN_GPU = max(c.kwargs["BLOCK_K"] for c in shrink_configs())
K_ALIGN_INTERP = 32
MAX_SPLITS = 8
ROWS_PER_SM = 64  # rows times splits per SM that keep enough of x in flight: K splits in two below 32 rows per SM
# The most row blocks (arrival counters) a launch has.
MIN_BLOCK_M = min(c.kwargs["BLOCK_M"] for c in shrink_configs())


def k_splits(M: int, K: int, device: torch.device) -> tuple[int, int]:
    """``(splits, k_per_split)`` of a shrink of ``x [M, K]`` on ``device``: ``ROWS_PER_SM * SMs // M`` splits, at
    most ``MAX_SPLITS`` and one per aligned K tile (so one split from ``ROWS_PER_SM / 2`` rows per SM up)."""
    if interpreting():
        align, sms = K_ALIGN_INTERP, 3
    else:
        align, sms = K_ALIGN_GPU, sm_count(device.index if device.index is not None else 0)
    splits = min(MAX_SPLITS, cdiv(K, align), sms * ROWS_PER_SM // max(M, 1))
    return (1, K) if splits <= 1 else aligned_pieces(K, splits, align)


def shrink_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_M"] <= max(32, next_pow2(nargs["M"]))


@triton.jit(do_not_specialize=["seed_salt", "k_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_shrink_kernel(
    x_ptr,
    u_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    M,
    K,
    R,
    k_per_split,
    num_splits,
    stride_xm,
    stride_xk,
    stride_uk,
    stride_ur,
    stride_om,
    stride_or,
    out_scale,
    p,
    seed_ptr,
    seed_salt: tl.int64,
    k_offset,
    DROP_PRE: tl.constexpr,
    ODD_OFFSET: tl.constexpr,
    DROP_POST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    R_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out [M, R] = out_scale * drop_post(drop_pre(x [M, K]) @ u [K, R])``, ``BLOCK_M`` rows and one K split a
    program; the "pre" mask at global columns ``k_offset + k``; ``SPLIT_K``: through fp32 ``ws [split, M, R_PAD]``."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    row0 = block * BLOCK_M
    k_start = split * k_per_split
    k_row, k_col = mask_keys(seed_ptr, seed_salt, DROP_PRE or DROP_POST)
    acc = shrink_rows(
        x_ptr + k_start.to(tl.int64) * stride_xk, u_ptr + k_start * stride_uk, row0, M,
        tl.minimum(k_per_split, K - k_start), R,
        stride_xm, stride_xk, stride_uk, stride_ur, out_scale, p, k_row, k_col, k_offset + k_start, DROP_PRE,
        ODD_OFFSET, DROP_POST, R_PAD, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_K, None, False,
    )  # fmt: skip
    if SPLIT_K:  # few rows, so M * stride_om is small
        finish_tile(
            tl.trans(acc), out_ptr, ws_ptr, count_ptr, block, 0, M, R, block, split, num_splits, stride_om,
            stride_or, M * R_PAD, 1.0, R_PAD, BLOCK_M,
        )
    else:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R_PAD)
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :] * stride_or
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))


SPEC = KernelSpec(
    name="shrink",
    configs=shrink_configs,
    key=("M", "K", "R"),
    smem=shrink_smem,
    work=lambda n: n["M"] * n["K"] * 128,  # bound by x's reads: timed from where a GEMM of as many reads would be
    fits=shrink_fits,
    dtype_arg="x_ptr",
    interp={"BLOCK_M": 32, "BLOCK_K": 32},
)


def lora_shrink(
    x: torch.Tensor,
    u: torch.Tensor,
    scale: float,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    k_offset: int = 0,
    drop_pre: bool = False,
    drop_post: bool = False,
    site: Site | None = None,
) -> torch.Tensor:
    """``x [M, K]``, ``u [K, r]`` (any strides) -> ``c * drop_post(drop_pre(x) @ u) [M, r]`` in ``x.dtype``,
    ``c = scale / (1 - p)`` under a mask, else ``scale``."""
    M, K = x.shape
    R = u.shape[1]
    dev = x.device
    out = output(x, M, R)
    if M == 0:
        return out
    info = site_info(site, k_splits, M, K, dev)
    splits, k_per_split = info
    ws, count = site_buffers(site, dev, _split_buffers, dev, splits, M, R) if splits > 1 else (out, out)  # unread
    c = shrink_scale(scale, p, drop_pre or drop_post)
    runtime = (float(c), float(p), *seed_arg(seed, x), int(k_offset))
    launch(site, (x, u, out, ws, count), runtime, _describe, x, u, out, splits, k_per_split, drop_pre, drop_post,
           k_offset, info=info)  # fmt: skip
    return out


def _split_buffers(device: torch.device, splits: int, M: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K launch's fp32 partials and row counters."""
    return (stream_buffer(G_PARTIALS, device, splits * M * pad_rank(R), torch.float32, zeroed=False),
            stream_buffer(G_COUNTERS, device, cdiv(M, MIN_BLOCK_M), torch.int32, zeroed=True))  # fmt: skip


def _describe(x, u, out, splits: int, k_per_split: int, drop_pre: bool, drop_post: bool, k_offset: int) -> tuple:
    """The launch of ``lora_shrink`` for this layout."""
    (M, K), R = x.shape, u.shape[1]
    odd = drop_pre and k_offset % 2 == 1

    def build():
        static = (M, K, R, k_per_split, splits, *x.stride(), *u.stride(), *out.stride())
        consts = {"DROP_PRE": drop_pre, "ODD_OFFSET": odd, "DROP_POST": drop_post, "SPLIT_K": splits > 1,
                  "R_PAD": pad_rank(R), **dot_options(x.dtype)}  # fmt: skip
        return static, lambda meta: (cdiv(M, meta["BLOCK_M"]), splits), consts

    signature = (x.shape, x.stride(), u.shape, u.stride(), x.dtype, u.dtype, drop_pre, odd, drop_post, splits)
    return SPEC, _lora_shrink_kernel, signature, build
