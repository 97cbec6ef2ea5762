"""The backward in one persistent TMA launch: ``dx = dy W + drop_pre(G A)`` on the GEMM programs, and a queue of the
``adapter_grads`` items (``dA = c * G^T drop_pre(x)``, ``dB = dy^T S``) on the spare ones, joined by the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adapter_grads import REDUCE_M_ALIGN_INTERP, grad_problems, partials_workspace, reduce_smem, split_buffers
from .blocks import gemm_tiles, reduce_item
from .dropout_mask import mask_keys
from .gemm_tma import GEMM_KEY, MAX_BLOCK_R, gemm_fits, gemm_work, rank_tma, tma_configs_with, tma_rows, tma_smem
from .host import dot_options, interpreting, keep_scale, pad_rank, seed_arg
from .launcher import Site, launch, output, site_buffers, site_info
from .spec import KernelSpec
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import COUNTERS, stream_buffer

# fmt: off


def dx_grads_configs() -> list[triton.Config]:
    """The TMA GEMM's configs, each with the reductions' column width ``RED_BLOCK_F``."""
    return tma_configs_with("RED_BLOCK_F", (128, 128, 128, 32))


def dx_grads_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    red = {"BLOCK_F": cfg["RED_BLOCK_F"], "BLOCK_M": consts["RED_BLOCK_M"]}
    # ``RED_STAGES`` buffers: Triton 3.6 allocates that many for an explicitly staged TMA loop (3.9 one fewer).
    red_smem = reduce_smem(red, consts["RED_STAGES"], elem, consts)
    return max(tma_smem(cfg, stages, elem, consts), red_smem) + ATOMIC_SLOT


ITEM_ROWS = 2048  # the launch's tail at 8192 x 4096 -> 14336: ~12 us, against ~46 with whole columns (H200)


def red_tiles(r_pad: int) -> tuple[int, int]:
    """``(RED_BLOCK_M, RED_STAGES)`` of the reductions: deep pipelines, fewer rows as the rank grows."""
    if interpreting():
        return REDUCE_M_ALIGN_INTERP, 2
    return (128 if r_pad <= 32 else 64 if r_pad <= 64 else 32), 5


@triton.jit
def sum_partials(
    part_ptr, out_ptr, tile, F, R, num_parts, stride_of, stride_or, R_PAD: tl.constexpr, BLOCK_F: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Store ``out [F, R]``'s column tile as ``sum_b part[b, tile, :R]`` (``shrink_db``'s partials, in b order)."""
    offs_f = tile * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    f_in = offs_f < F
    ptrs = part_ptr + offs_f[:, None] * R_PAD + offs_r[None, :]
    total = tl.zeros((BLOCK_F, R_PAD), dtype=tl.float32)
    for _ in tl.range(0, num_parts, num_stages=STAGES):
        total += tl.load(ptrs, mask=f_in[:, None], other=0.0)
        ptrs += F * R_PAD
    out_ptrs = out_ptr + offs_f[:, None] * stride_of + offs_r[None, :] * stride_or
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=f_in[:, None] & (offs_r[None, :] < R))


@triton.jit(do_not_specialize=["seed_salt", "k_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _dx_and_grads_kernel(
    dy_ptr, w_ptr, g_ptr, a_ptr, dx_ptr,
    fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr, pdb_ptr, db_ptr,
    M, N_OUT, K_RED, R, F_A, F_B, m_per_split, num_splits, F_DB, db_parts,
    stride_dym, stride_w, stride_gm, stride_gr, stride_ar, stride_ak, stride_dxm,
    stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf, stride_oar,
    stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws, stride_dbf, stride_dbr,
    keep_scale, p, seed_ptr, seed_salt: tl.int64, k_offset,
    W_NK: tl.constexpr, DB_SUMS: tl.constexpr, LORA_DROP: tl.constexpr, ODD_OFFSET: tl.constexpr,
    RANK_TMA: tl.constexpr, F_T: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    RED_BLOCK_F: tl.constexpr, RED_BLOCK_M: tl.constexpr, RED_STAGES: tl.constexpr,
):
    """dx's GEMM has ``N_OUT = K``, ``K_RED = N``; ``F_A = 0`` / ``F_B = 0`` skips dA / dB's reduction, ``F_DB > 0``
    sums dB's partials ``pdb`` into ``db``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # As many GEMM programs as keep the number of waves; the rest start on the queue.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N_OUT, BLOCK_N)
    gemm_programs = tl.cdiv(num_tiles, tl.cdiv(num_tiles, programs))
    k_row, k_col = mask_keys(seed_ptr, seed_salt, LORA_DROP)
    if pid < gemm_programs:
        gemm_tiles(
            dy_ptr, w_ptr, dx_ptr, g_ptr, a_ptr, dx_ptr, M, N_OUT, K_RED, R,
            stride_dym, stride_w, stride_gm, stride_gr, stride_ar, stride_ak, stride_dxm, 0,
            keep_scale, p, k_row, k_col, k_offset, pid, gemm_programs,
            W_NK, False, LORA_DROP, ODD_OFFSET, RANK_TMA, F_T, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, BLOCK_M,
            BLOCK_N, BLOCK_K, GROUP_M,
        )  # fmt: skip

    num_items = (tl.cdiv(F_A, RED_BLOCK_F) + tl.cdiv(F_B, RED_BLOCK_F)) * num_splits
    queue = count_ptr + F_A + F_B  # [head, finished programs], after the tiles' arrival counters
    item = tl.atomic_add(queue, 1, sem="relaxed", scope="gpu")
    sums = 0
    if DB_SUMS:
        # dB's sums first: their partials were just written, likeliest still in L2.
        sums = tl.cdiv(F_DB, RED_BLOCK_F)
        while item < sums:
            sum_partials(
                pdb_ptr, db_ptr, item, F_DB, R, db_parts, stride_dbf, stride_dbr, R_PAD, RED_BLOCK_F, RED_STAGES
            )
            item = tl.atomic_add(queue, 1, sem="relaxed", scope="gpu")
        item -= sums
    while item < num_items:
        reduce_item(
            item // num_splits, item % num_splits, fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr,
            count_ptr, M, F_A, F_B, R, m_per_split, num_splits, stride_fam, stride_faf, stride_gam, stride_gar,
            stride_oaf, stride_oar, stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr,
            stride_ws, keep_scale, p, k_row, k_col, k_offset, LORA_DROP, ODD_OFFSET, A_TMA, B_TMA, R_PAD,
            UPCAST, DOT_PRECISION, RED_BLOCK_F, RED_BLOCK_M, RED_STAGES,
        )
        item = tl.atomic_add(queue, 1, sem="relaxed", scope="gpu") - sums
    # The last program to finish leaves the queue at zero for the stream's next launch.
    finished = tl.atomic_add(queue + 1, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:
        tl.atomic_xchg(queue, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(queue + 1, 0, sem="relaxed", scope="gpu")


SPEC = KernelSpec(
    name="dx_grads",
    configs=dx_grads_configs,
    key=GEMM_KEY,
    smem=dx_grads_smem,
    work=gemm_work,
    fits=gemm_fits,
    dtype_arg="dy_ptr",
    interp={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "RED_BLOCK_F": 32},
    descriptors=lambda consts: True,
)


def _buffers(device: torch.device, split: int, partials: int, counters: int) -> tuple:
    """``(fp32 partials or None with one split, the queue and column counters)``."""
    if split > 1:
        return split_buffers(device, partials, counters)
    return None, stream_buffer(COUNTERS, device, counters, torch.int32, zeroed=True)


def lora_dx_and_grads(
    dy: torch.Tensor,
    w: torch.Tensor,
    w_nk: bool,
    g: torch.Tensor,
    lora_A: torch.Tensor,
    x: torch.Tensor | None,
    s_lora: torch.Tensor | None,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    k_offset: int = 0,
    lora_drop: bool = False,
    db_partials: torch.Tensor | None = None,
    db_parts: int = 0,
    like: torch.Tensor | None = None,
    site: Site | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dA, dB)``: ``dx [M, K] = dy @ W + drop(G @ A)``, ``dA = c * G^T drop(x)`` if ``x`` is given,
    ``dB = dy^T S`` if ``s_lora`` is given, or the sum of ``shrink_db``'s ``db_partials``; dA, dB in ``like``'s dtype
    (None: dy's). ``w`` as ``gemm_tma.tma_operand`` gives W; ``drop``: the "pre" mask of columns ``k_offset + k``,
    ``c = 1/(1-p)``."""
    M, N = dy.shape
    K, R = lora_A.shape[1], g.shape[1]
    want_a, want_b = x is not None, s_lora is not None
    sums = db_partials is not None
    dev, like = dy.device, dy if like is None else like
    dx = output(dy, M, K)
    if want_a or want_b:
        problems = grad_problems(x, g if want_a else None, dy if want_b else None, s_lora, like)
    else:  # dB from its partials alone: the reductions get no columns and borrow (dy, G, G) for their pointers
        problems = None, None, (dy, g, g), (dy, g, g)
    dA, dB, (feat_a, g_a, out_a), (feat_b, g_b, out_b) = problems
    F_A = K if want_a else 0
    F_B = N if want_b else 0
    if sums:
        dB = output(like, N, R)
    pdb = db_partials if sums else out_a
    info = site_info(site, partials_workspace, M, F_A + F_B, R, dev, ITEM_ROWS)
    split, m_per_split, partials = info
    ws, count = site_buffers(site, dev, _buffers, dev, split, partials, F_A + F_B + 2)
    ws = out_a if ws is None else ws
    tensors = (dy, w, g, lora_A, dx, feat_a, g_a, out_a, feat_b, g_b, out_b, ws, count, pdb, dB if sums else out_a)
    runtime = (keep_scale(p, lora_drop), float(p), *seed_arg(seed, dy), int(k_offset))
    launch(site, tensors, runtime, _describe, tensors, w_nk, x, s_lora, sums, db_parts, split, m_per_split, lora_drop,
           k_offset, info=info)
    return dx, dA, dB


def _describe(tensors: tuple, w_nk: bool, x, s_lora, sums: bool, db_parts: int, split: int, m_per_split: int,
              lora_drop: bool, k_offset: int) -> tuple:
    dy, w, g, lora_A, dx, feat_a, g_a, out_a, feat_b, g_b, out_b, *_ = tensors
    M, N = dy.shape
    K, R = lora_A.shape[1], g.shape[1]
    want_a, want_b = x is not None, s_lora is not None
    F_A, F_B, F_DB = K if want_a else 0, N if want_b else 0, N if sums else 0
    num_sms = 2 if interpreting() else sm_count(dy.device.index or 0)
    odd = lora_drop and k_offset % 2 == 1

    def build():
        r_pad = pad_rank(R)
        static = (M, K, N, R, F_A, F_B, m_per_split, split, F_DB, db_parts, dy.stride(0), w.stride(0), *g.stride(),
                  *lora_A.stride(), dx.stride(0), *feat_a.stride(), *g_a.stride(), out_a.stride(1), out_a.stride(0),
                  *feat_b.stride(), *g_b.stride(), *out_b.stride(), (F_A + F_B) * r_pad, R, 1)
        consts = {
            "W_NK": w_nk,
            "DB_SUMS": sums,
            "LORA_DROP": lora_drop,
            "ODD_OFFSET": odd,
            **rank_tma(g, lora_A, lora_drop),
            "A_TMA": want_a and tma_rows(feat_a),
            "B_TMA": want_b and tma_rows(feat_b),
            "R_PAD": r_pad,
            "BLOCK_R": min(r_pad, MAX_BLOCK_R),
            **dict(zip(("RED_BLOCK_M", "RED_STAGES"), red_tiles(r_pad), strict=True)),
            **dot_options(dy.dtype),
        }
        return static, lambda meta: (num_sms,), consts

    a_layout = want_a and (x.stride(), tma_rows(x))
    signature = (dy.shape, dy.stride(), w.shape, w.stride(), w_nk, g.stride(), lora_A.shape, lora_A.stride(),
                 lora_A.dtype, a_layout, want_b and s_lora.stride(), sums and db_parts, dy.dtype, out_a.dtype,
                 tensors[-1].dtype, lora_drop, odd, num_sms)
    return SPEC, _dx_and_grads_kernel, signature, build
