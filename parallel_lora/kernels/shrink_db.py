"""From one read of dy: ``G = c * drop_post(dy [M, N] @ B [N, r])`` and dB's fp32 partial sums per row block b,
``P[b] = dy[rows b]^T S[rows b]`` ``[blocks, N, r_pad]``, which ``dx_grads`` sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import as_operand, finish_tile
from .dropout_mask import drop_tile, mask_keys
from .host import aligned_pieces, cdiv, dot_options, interpreting, pad_rank, seed_arg, shrink_scale
from .launcher import Site, launch, output, site_buffers, site_info
from .spec import KernelSpec, adapter_bytes
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import DB_PARTIALS, G_COUNTERS, G_PARTIALS, stream_buffer


def shrink_db_configs() -> list[triton.Config]:
    """The configs (BLOCK_N, stages, warps); the rows per program are fixed (``db_rows``)."""
    rows = [
        (32, 2, 4),
        (64, 3, 4),
        (64, 3, 8),
        (64, 4, 8),
        (128, 2, 8),
        (128, 3, 8),
    ]
    return [triton.Config({"BLOCK_N": bn}, num_stages=s, num_warps=w) for bn, s, w in rows]


def shrink_db_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The last term: dB's fp32 partial, staged for a coalesced store.
    rows, bn, r_pad = consts["ROWS"], cfg["BLOCK_N"], consts["R_PAD"]
    b_tile = adapter_bytes(bn * r_pad, stages, elem, consts, "b_ptr")
    return (stages * rows * bn + rows * r_pad) * elem + b_tile + bn * r_pad * 4 + ATOMIC_SLOT


# Column ranges are multiples of the largest BLOCK_N in ``shrink_db_configs`` (GPU, interpreter).
N_ALIGN_GPU = 128
N_ALIGN_INTERP = 32
# The backward at 8192 x 4096 -> 4096 (H100, H200): r16 2% and r32 2.7% faster, r64 2% slower.
MAX_DB_R_PAD = 32
MIN_M_GPU = 8192
MAX_DB_PARTIALS_BYTES = 64 << 20  # 8192 x 14336 takes 28 MiB at r16; more tokens reduce dB from dy
PROGRAMS_PER_SM = 1
MAX_SPLITS = 8  # the row block's last arrival sums that many G partials alone


# fmt: off
@triton.jit(do_not_specialize=["seed_salt"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_shrink_db_kernel(
    dy_ptr, b_ptr, s_ptr, g_ptr, pdb_ptr, pg_ptr, count_ptr,
    M, N, R, n_per_split, num_splits,
    stride_dym, stride_dyn, stride_bn, stride_br, stride_sm, stride_sr, stride_gm, stride_gr,
    out_scale, p, seed_ptr, seed_salt: tl.int64,
    DROP_POST: tl.constexpr, R_PAD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
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
        u = as_operand(u, d.dtype, UPCAST)
        if UPCAST:
            d = d.to(tl.float32)
            u = u.to(tl.float32)
        acc = tl.dot(d, u, acc, input_precision=DOT_PRECISION)
        part = tl.dot(tl.trans(d), s, input_precision=DOT_PRECISION)
        tl.store(pdb_ptrs + n0 * R_PAD, part, mask=n_in[:, None])
    if DROP_POST:
        k_row, k_col = mask_keys(seed_ptr, seed_salt, DROP_POST)
        acc = drop_tile(acc, k_row, k_col, p, offs_m, 0, False)
    finish_tile(
        tl.trans(acc * out_scale), g_ptr, pg_ptr, count_ptr, block, 0, M, R, block, split, num_splits,
        stride_gm, stride_gr, M * R_PAD, 1.0, R_PAD, ROWS,
    )


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
    """Whether a fused backward of ``M`` tokens, ``N`` outputs and padded rank ``r_pad`` takes dB's partials here."""
    if r_pad > MAX_DB_R_PAD or db_blocks(M) * N * r_pad * 4 > MAX_DB_PARTIALS_BYTES:
        return False
    return M >= (0 if interpreting() else MIN_M_GPU)


def db_rows() -> int:
    """Rows per program: as many as G's fp32 accumulator allows beside the dy tile (fewer were slower)."""
    return 32 if interpreting() else 256


def db_blocks(M: int) -> int:
    """How many partials of dB the launch leaves (the row blocks)."""
    return cdiv(M, db_rows())


def column_splits(M: int, N: int, device: torch.device) -> tuple[int, int]:
    """``(splits, n_per_split)``: dy's columns split so that row blocks times splits fill the SMs once."""
    if interpreting():
        align, programs = N_ALIGN_INTERP, 8
    else:
        align = N_ALIGN_GPU
        programs = PROGRAMS_PER_SM * sm_count(device.index if device.index is not None else 0)
    splits = max(1, min(MAX_SPLITS, programs // db_blocks(M), cdiv(N, align)))
    return aligned_pieces(N, splits, align)


def _workspace(M: int, N: int, device: torch.device) -> tuple[int, int, int]:
    return (*column_splits(M, N, device), db_blocks(M))


def _buffers(device: torch.device, M: int, N: int, r_pad: int, splits: int, blocks: int) -> tuple:
    """``(dB partials, G partials or None without splits, counters)``."""
    pg = stream_buffer(G_PARTIALS, device, splits * M * r_pad, torch.float32, zeroed=False) if splits > 1 else None
    return (stream_buffer(DB_PARTIALS, device, blocks * N * r_pad, torch.float32, zeroed=False), pg,
            stream_buffer(G_COUNTERS, device, blocks, torch.int32, zeroed=True))  # fmt: skip


def lora_shrink_db(
    dy: torch.Tensor,
    lora_B: torch.Tensor,
    s_lora: torch.Tensor,
    scale: float,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    drop_post: bool = False,
    site: Site | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(G [M, r], P, blocks)`` from ``dy [M, N]``, ``B [N, r]``, ``S [M, r]`` (``M > 0``): ``dB = sum_b P[b, :, :r]``,
    ``P`` a flat per-stream fp32 workspace valid until the stream's next launch."""
    M, N = dy.shape
    R = lora_B.shape[1]
    r_pad = pad_rank(R)
    dev = dy.device
    g = output(dy, M, R)
    info = site_info(site, _workspace, M, N, dev)
    splits, n_per_split, blocks = info
    pdb, pg, count = site_buffers(site, dev, _buffers, dev, M, N, r_pad, splits, blocks)
    pg = g if pg is None else pg
    c = shrink_scale(scale, p, drop_post)
    tensors = (dy, lora_B, s_lora, g, pdb, pg, count)
    runtime = (float(c), float(p), *seed_arg(seed, dy))
    launch(site, tensors, runtime, _describe, dy, lora_B, s_lora, g, splits, n_per_split, blocks, drop_post, info=info)
    return g, pdb, blocks


def _describe(dy, lora_B, s_lora, g, splits: int, n_per_split: int, blocks: int, drop_post: bool) -> tuple:
    M, N = dy.shape
    R = lora_B.shape[1]

    def build():
        static = (M, N, R, n_per_split, splits, *dy.stride(), *lora_B.stride(), *s_lora.stride(), *g.stride())
        consts = {"DROP_POST": drop_post, "R_PAD": pad_rank(R), "ROWS": db_rows(), **dot_options(dy.dtype)}
        return static, lambda meta: (blocks, splits), consts

    signature = (dy.shape, dy.stride(), lora_B.shape, lora_B.stride(), s_lora.stride(), dy.dtype, lora_B.dtype,
                 drop_post, splits, db_rows())
    return SPEC, _lora_shrink_db_kernel, signature, build
