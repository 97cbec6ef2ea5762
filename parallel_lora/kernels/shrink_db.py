"""The backward's shrink and dB's partial sums from one read of dy:

    G = s * drop_post(dy B)            [M, r]              dy [M, N], B [N, r]
    P[b] = dy[rows b]^T S[rows b]      [blocks, N, r_pad]  fp32, one partial of dB = dy^T S per row block b

Why: the fused backward launch (``dx_grads``) reduces dA (a read of x) and dB (a read of dy) on the dx GEMM's
spare SMs, and at 8192 x 4096 -> 4096, r16, the two together overflow that spare time, where either one alone
fits. The G launch before it reads all of dy anyway; here each dy tile it loads also feeds
``dy_tile^T S_rows``, so dx_grads only sums ``blocks`` partials per column (``dx_grads.sum_partials``, ~1/8 of
dy's bytes at r16, ~1/4 at r32) instead of reading dy again.

A program owns ``ROWS`` rows (a fixed function of the shape, never of the tuned config, so that the sums run in
the same order whatever the tuner picks) and one of ``splits`` ranges of dy's columns; it streams its
``[ROWS, BLOCK_N]`` tiles once: ``acc [ROWS, R_PAD] += tile @ B_tile`` and ``P[b, cols] = tile^T @ S_rows``.
With several column splits each program stores its G partial and the row block's last arrival sums them in
split order (``blocks.finish_tile``); the "post" mask zeroes the same elements of every partial, so it is
applied to each (exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import finish_tile
from .dropout_mask import drop_tile, mask_keys
from .host import cdiv, dot_options, interpreting, pad_rank, seed_arg, shrink_scale
from .launcher import Site, launch, site_info
from .spec import KernelSpec
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import DB_PARTIALS, G_COUNTERS, G_PARTIALS, stream_buffer


def shrink_db_configs() -> list[triton.Config]:
    """(BLOCK_N, stages, warps); the rows per program are fixed (``db_rows``), not tuned, so that dB's partials sum
    in one order."""
    rows = [
        (32, 2, 4),  # the fallback that fits ~100 KB
        (64, 3, 4),
        (64, 3, 8),
        (64, 4, 8),
        (128, 2, 8),
        (128, 3, 8),
    ]
    return [triton.Config({"BLOCK_N": bn}, num_stages=s, num_warps=w) for bn, s, w in rows]


def shrink_db_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Per stage a dy tile and a B tile; S's rows once (the second dot's operand); the fp32 partial of dB on its
    # way to a coalesced store (4 KB past the tiles at BLOCK_N 64, compiled for sm_90a), and the arrival's atomic.
    rows, bn, r_pad = consts["ROWS"], cfg["BLOCK_N"], consts["R_PAD"]
    return (stages * (rows * bn + bn * r_pad) + rows * r_pad) * elem + bn * r_pad * 4 + ATOMIC_SLOT


# The column ranges are a multiple of the largest BLOCK_N in ``shrink_db_configs`` (of the interpreter's).
N_ALIGN_GPU = 128
N_ALIGN_INTERP = 32
# Where this path pays (``takes_db_partials``; the backward at 8192 x 4096 -> 4096, H100 and H200): r16 2% and
# r32 2.7% faster, r64 2% slower (G's launch costs twice the plain G's); below 8192 tokens the dx launch has little
# tail to remove, and the host time the path adds per backward could show in eager launches.
MAX_DB_R_PAD = 32
MIN_M_GPU = 8192
# The partials stay allocated with the stream's other workspaces and grow with the tokens: past this size the
# backward reduces dB from dy instead (64 MiB: 8192 x 14336 is 28 MiB at r16, 56 at r32; 65536 tokens at
# N = 14336 would hold 224 MiB at r16), against dy's 64 MiB at 8192 x 4096 that dx_grads would otherwise read.
MAX_DB_PARTIALS_BYTES = 64 << 20
# Programs per SM the column splits aim at (one wave).
PROGRAMS_PER_SM = 1
# At most this many column splits: the row block's last arrival sums that many G partials alone.
MAX_SPLITS = 8


@triton.jit(do_not_specialize_on_alignment=["seed_ptr"])
def _lora_shrink_db_kernel(
    # dy [M, N], B [N, R], S [M, R] -> G [M, R]; the dB partials [blocks, N, R_PAD], the G partials
    # [splits, M, R_PAD] and the row blocks' arrival counters; seed_ptr: the call's seed ([1] int64, read under the
    # mask only)
    dy_ptr, b_ptr, s_ptr, g_ptr, pdb_ptr, pg_ptr, count_ptr,
    M, N, R, n_per_split, num_splits,
    stride_dym, stride_dyn, stride_bn, stride_br, stride_sm, stride_sr, stride_gm, stride_gr,
    out_scale, p, seed_ptr,
    DROP_POST: tl.constexpr, R_PAD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    split = tl.program_id(1)
    n_start = split * n_per_split
    n_end = tl.minimum(n_start + n_per_split, N)
    offs_m = block * ROWS + tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    m_in = offs_m < M
    r_in = offs_r < R
    rows64 = offs_m.to(tl.int64)  # M * stride can pass 2**31
    s = tl.load(s_ptr + rows64[:, None] * stride_sm + offs_r[None, :] * stride_sr,
                mask=m_in[:, None] & r_in[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        s = s.to(tl.float32)
    # Partial b holds columns [0, N) of row block b, R_PAD wide: the padding comes out zero (S's is).
    pdb_ptrs = pdb_ptr + block.to(tl.int64) * N * R_PAD + offs_n[:, None] * R_PAD + offs_r[None, :]
    acc = tl.zeros((ROWS, R_PAD), dtype=tl.float32)
    for n0 in tl.range(n_start, n_end, BLOCK_N):
        cols = n0 + offs_n
        n_in = cols < n_end
        d = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :] * stride_dyn,
                    mask=m_in[:, None] & n_in[None, :], other=0.0)  # fmt: skip
        u = tl.load(b_ptr + cols[:, None] * stride_bn + offs_r[None, :] * stride_br,
                    mask=n_in[:, None] & r_in[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            d = d.to(tl.float32)
            u = u.to(tl.float32)
        acc = tl.dot(d, u, acc, input_precision=DOT_PRECISION)
        part = tl.dot(tl.trans(d), s, input_precision=DOT_PRECISION)
        tl.store(pdb_ptrs + n0 * R_PAD, part, mask=n_in[:, None])
    if DROP_POST:
        k_row, k_col = mask_keys(seed_ptr, DROP_POST)
        acc = drop_tile(acc, k_row, k_col, p, offs_m, 0, False)
    # finish_tile takes [R_PAD, columns] tiles: G's rows are its columns here.
    finish_tile(
        tl.trans(acc * out_scale), g_ptr, pg_ptr, count_ptr, block, 0, M, R, block, split, num_splits,
        stride_gm, stride_gr, M * R_PAD, 1.0, R_PAD, ROWS,
    )  # fmt: skip


SPEC = KernelSpec(
    name="shrink_db",
    configs=shrink_db_configs,
    key=("M", "N", "R"),
    smem=shrink_db_smem,
    work=lambda n: 2 * n["M"] * n["N"] * n["R"],
    fits=lambda cfg, nargs: True,
    dtype_arg="dy_ptr",
    interp={"BLOCK_N": 32},
)


def takes_db_partials(M: int, N: int, r_pad: int) -> bool:
    """Whether a fused backward of ``M`` tokens, ``N`` output features and padded rank ``r_pad`` takes dB's
    partials from this launch."""
    if r_pad > MAX_DB_R_PAD or db_blocks(M) * N * r_pad * 4 > MAX_DB_PARTIALS_BYTES:
        return False
    return M >= (0 if interpreting() else MIN_M_GPU)


def db_rows() -> int:
    """Rows per program: the partials of dB take ``M / rows * N * r_pad * 4`` bytes, so as many as G's
    ``[rows, r_pad]`` fp32 accumulator allows beside the ``[rows, BLOCK_N]`` dy tile (256: 16 registers a thread at
    r_pad 16, 32 at r_pad 32; fewer rows at 2 programs an SM were slower)."""
    return 32 if interpreting() else 256


def db_blocks(M: int) -> int:
    """How many partials of dB the launch leaves (the row blocks)."""
    return cdiv(M, db_rows())


def column_splits(M: int, N: int, device: torch.device) -> tuple[int, int]:
    """``(splits, n_per_split)``: dy's columns split so that row blocks times splits fill the device's SMs once
    (one wave: a program holds most of an SM's shared memory), a function of the shape and the device only."""
    if interpreting():
        align, programs = N_ALIGN_INTERP, 8  # small, so that test-sized problems split
    else:
        align = N_ALIGN_GPU
        programs = PROGRAMS_PER_SM * sm_count(device.index if device.index is not None else 0)
    splits = max(1, min(MAX_SPLITS, programs // db_blocks(M), cdiv(N, align)))
    n_per_split = cdiv(cdiv(N, splits), align) * align
    return cdiv(N, n_per_split), n_per_split


def _workspace(M: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """``(splits, n_per_split, blocks)``: the launch's column splits and row blocks (its workspaces' sizes)."""
    return (*column_splits(M, N, device), db_blocks(M))


def lora_shrink_db(
    dy: torch.Tensor,
    lora_B: torch.Tensor,
    s_lora: torch.Tensor,
    scale: float,
    *,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    drop_post: bool = False,
    site: Site | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``dy [M, N]``, ``B [N, r]``, ``S [M, r]`` (one dtype) -> ``(G [M, r], P, blocks)``: ``G = c * drop_post(dy
    B)`` in dy's dtype (``c = scale / (1 - p)`` with ``drop_post``, keyed by ``seed``) and the fp32 partials of
    ``dB = dy^T S = sum_b P[b, :, :r]``, ``P`` the first ``blocks * N * r_pad`` elements of a flat per-stream
    workspace, valid until the next launch on the stream. ``M > 0``; inputs checked by the caller, which passes a
    ``site`` bound to this operand layout."""
    M, N = dy.shape
    R = lora_B.shape[1]
    r_pad = pad_rank(R)
    dev = dy.device
    g = torch.empty((M, R), device=dev, dtype=dy.dtype)
    info = site_info(site, _workspace, M, N, dev)
    splits, n_per_split, blocks = info
    pdb = stream_buffer(DB_PARTIALS, dev, blocks * N * r_pad, torch.float32, zeroed=False)
    pg = stream_buffer(G_PARTIALS, dev, splits * M * r_pad, torch.float32, zeroed=False) if splits > 1 else g
    count = stream_buffer(G_COUNTERS, dev, blocks, torch.int32, zeroed=True)
    c = shrink_scale(scale, p, drop_post)
    tensors = (dy, lora_B, s_lora, g, pdb, pg, count)
    runtime = (float(c), float(p), seed_arg(seed, dy))
    launch(site, tensors, runtime, _describe, dy, lora_B, s_lora, g, splits, n_per_split, blocks, drop_post, info=info)
    return g, pdb, blocks


def _describe(dy, lora_B, s_lora, g, splits: int, n_per_split: int, blocks: int, drop_post: bool) -> tuple:
    """The launch of ``lora_shrink_db`` for this layout."""
    M, N = dy.shape
    R = lora_B.shape[1]

    def build():
        static = (M, N, R, n_per_split, splits, *dy.stride(), *lora_B.stride(), *s_lora.stride(), *g.stride())
        consts = {"DROP_POST": drop_post, "R_PAD": pad_rank(R), "ROWS": db_rows(), **dot_options(dy.dtype)}
        return static, lambda meta: (blocks, splits), consts

    signature = (dy.shape, dy.stride(), lora_B.shape, lora_B.stride(), s_lora.stride(), dy.dtype, drop_post, splits,
                 db_rows())  # fmt: skip
    return SPEC, _lora_shrink_db_kernel, signature, build
