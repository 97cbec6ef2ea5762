"""Both adapter gradients in one launch, as deterministic reductions over M:

    out[F, r] = c * drop(feat)^T @ g        feat [M, F], g [M, r]

    dA = G^T drop_pre(x)   [r, K]:   feat = x  [M, K], g = G [M, r], c = 1/(1-p) under "pre" (mask on x)
    dB = dy^T S            [N, r]:   feat = dy [M, N], g = S [M, r], c = 1

(dA is written through transposed output strides, so both land in their natural layout.) The grid's first
axis covers the ``BLOCK_F`` column tiles of x, then those of dy; a program owns one tile and the whole padded
rank, ``acc [R_PAD, BLOCK_F]`` (fp32), and walks one contiguous chunk of ``m_per_split`` rows in ``BLOCK_M``
steps, ``acc += g_tile^T @ feat_tile``: the big operand stays in its row-major layout, through a TMA
descriptor where its rows allow (16-bit, Hopper), else through pointers.

With one split a program stores its tile. With several, each stores an fp32 partial and bumps its tile's
arrival counter; the last to arrive sums the partials in split order (a fixed order: bitwise reproducible, no
atomics on the data), stores the tile and resets the counter for the next launch. So the whole reduction is
one launch at any M; the host issues no sum and no cast (each cost 15-25 us of host time on autograd's device
thread on the H200 machine, more than the reduction itself at short M). The split count depends only on the
shape (never on the tuned config), and every split length is a multiple of every config's ``BLOCK_M``.

The reduction form runs at about 2.5 TB/s on the H200 at M, F = 8192, 4096 (3.3 TB/s at F = 14336) against
1.3 TB/s for the earlier ``feat^T [F, M] @ g`` form (``benchmarks/probe_gemm.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import cdiv, dot_options, interpreting, pad_rank, split_seed, stream_buffer
from .configs import (
    REDUCE_M_ALIGN_GPU,
    REDUCE_M_ALIGN_INTERP,
    KernelSpec,
    Site,
    launch,
    reduce_configs,
    reduce_fits,
    reduce_smem,
    sm_count,
)
from .dropout_mask import drop_tile
from .gemm_tma import ensure_allocator, tma_rows


@triton.jit
def reduce_tile(
    feat_ptr, g_ptr, M, F, R, m_start, m_end, tile_f, stride_fm, stride_ff, stride_gm, stride_gr,
    p, seed_lo, seed_hi, f_offset,
    DROP_FEAT: tl.constexpr, ODD_OFFSET: tl.constexpr, FEAT_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """``g[m_start:m_end]^T @ drop(feat[m_start:m_end, tile])`` as an fp32 ``[R_PAD, BLOCK_F]`` tile; the M loop
    in ``STAGES`` stages (None: the launch's ``num_stages``). ``ODD_OFFSET``: ``f_offset`` is odd."""
    offs_f = tile_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    offs_mb = tl.arange(0, BLOCK_M)
    f_in = offs_f < F
    r_in = offs_r < R
    if FEAT_TMA:
        # Rows past M come back as zeros; a split ends on a BLOCK_M boundary, so no tile crosses into the
        # next split.
        feat_desc = tl.make_tensor_descriptor(feat_ptr, [M, F], [stride_fm, 1], [BLOCK_M, BLOCK_F])
    acc = tl.zeros((R_PAD, BLOCK_F), dtype=tl.float32)
    for m0 in tl.range(m_start, m_end, BLOCK_M, num_stages=STAGES):
        offs_m = m0 + offs_mb
        m_in = offs_m < m_end
        rows64 = offs_m.to(tl.int64)  # M * stride can pass 2**31
        if FEAT_TMA:
            ft = feat_desc.load([m0, tile_f * BLOCK_F])
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
            ft = drop_tile(ft, seed_lo, seed_hi, p, offs_m, f_offset + tile_f * BLOCK_F, ODD_OFFSET)
        if UPCAST:
            ft = ft.to(tl.float32)
            gt = gt.to(tl.float32)
        acc = tl.dot(gt, ft, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def finish_tile(
    acc, out_ptr, ws_ptr, count_ptr, tile, ws_col0, F, R, tile_f, pid_s, num_splits, stride_of, stride_or,
    stride_ws, out_scale, R_PAD: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """Store ``out_scale * sum over splits`` of this tile: directly with one split, else through the fp32
    partials ``ws [split, F_A + F_B, R_PAD]`` (columns from ``ws_col0``) and the tile's arrival counter."""
    offs_f = tile_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    out_ptrs = out_ptr + offs_r[:, None] * stride_or + offs_f[None, :] * stride_of
    if num_splits == 1:
        tl.store(out_ptrs, (acc * out_scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (ws_col0 + offs_f[None, :]) * R_PAD + offs_r[:, None]
        tl.store(ws_ptr + pid_s * stride_ws + part, acc, mask=mask)
        # Every thread's partial is written before one thread's release-ordered arrival; the last arrival's
        # acquire orders the reads below after everyone's writes (.cg: read at L2, where they landed).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = tl.zeros((R_PAD, BLOCK_F), dtype=tl.float32)
            for s in range(0, num_splits):
                total += tl.load(ws_ptr + s * stride_ws + part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total * out_scale).to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def sum_partials(
    part_ptr, out_ptr, tile, F, R, num_parts, stride_of, stride_or, R_PAD: tl.constexpr, BLOCK_F: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """Store ``sum_b part[b, tile's columns, :R]`` (fp32 partials ``[num_parts, F, R_PAD]``, summed in ``b``
    order) as ``out [F, R]``: the last step of dB when its partials come from ``shrink_db``."""
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


@triton.jit
def reduce_item(
    tile, pid_s, fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
    M, F_A, F_B, R, m_per_split, num_splits,
    stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf, stride_oar,
    stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws,
    scale_a, p, seed_lo, seed_hi, f_offset,
    DROP_A: tl.constexpr, ODD_OFFSET: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """One work item: column tile ``tile`` (of x's tiles, then dy's) over M split ``pid_s``, reduced and
    finished (stored, or its partial added to the tile's split sum). Shared by this file's kernel (an item per
    program) and the backward's fused launch (items off a queue)."""
    m_start = pid_s * m_per_split
    m_end = tl.minimum(m_start + m_per_split, M)
    tiles_a = tl.cdiv(F_A, BLOCK_F)
    if tile < tiles_a:
        acc = reduce_tile(
            fa_ptr, ga_ptr, M, F_A, R, m_start, m_end, tile, stride_fam, stride_faf, stride_gam, stride_gar,
            p, seed_lo, seed_hi, f_offset, DROP_A, ODD_OFFSET, A_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M,
            STAGES,
        )  # fmt: skip
        finish_tile(
            acc, outa_ptr, ws_ptr, count_ptr, tile, 0, F_A, R, tile, pid_s, num_splits, stride_oaf, stride_oar,
            stride_ws, scale_a, R_PAD, BLOCK_F,
        )  # fmt: skip
    else:
        tile_b = tile - tiles_a
        acc = reduce_tile(
            fb_ptr, gb_ptr, M, F_B, R, m_start, m_end, tile_b, stride_fbm, stride_fbf, stride_gbm, stride_gbr,
            p, seed_lo, seed_hi, 0, False, False, B_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M, STAGES,
        )  # fmt: skip
        finish_tile(
            acc, outb_ptr, ws_ptr, count_ptr, tile, F_A, F_B, R, tile_b, pid_s, num_splits, stride_obf,
            stride_obr, stride_ws, 1.0, R_PAD, BLOCK_F,
        )  # fmt: skip


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "f_offset"])
def _lora_adapter_grads_kernel(
    # pointers: problem a (dA: x, G) and problem b (dB: dy, S), the partials and the arrival counters
    fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
    # sizes (F_A = 0 or F_B = 0 skips that gradient)
    M, F_A, F_B, R, m_per_split, num_splits,
    # strides
    stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf, stride_oar,
    stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws,
    # runtime scalars (changing them never recompiles)
    scale_a, p, seed_lo, seed_hi, f_offset,
    # compile-time
    DROP_A: tl.constexpr, ODD_OFFSET: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    reduce_item(
        tl.program_id(0), tl.program_id(1), fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
        M, F_A, F_B, R, m_per_split, num_splits, stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf,
        stride_oar, stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws, scale_a, p,
        seed_lo, seed_hi, f_offset, DROP_A, ODD_OFFSET, A_TMA, B_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M,
        None,
    )  # fmt: skip


_SPEC = KernelSpec(
    name="reduce",
    configs=reduce_configs,
    key=("M", "F_A", "F_B", "R"),
    smem=reduce_smem,
    work=lambda n: n["M"] * (n["F_A"] + n["F_B"]) * n["R"],
    fits=reduce_fits,
    dtype_arg="fa_ptr",
)


def _num_programs_target(device: torch.device) -> int:
    if interpreting():
        return 8  # small, so that test-sized problems exercise the multi-split path
    return 2 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_rows(M: int, F: int, device: torch.device, max_rows: int | None = None) -> tuple[int, int]:
    """``(split, m_per_split)`` for the M reduction over ``F`` feature columns in all: enough programs to fill
    the device when ``F / BLOCK_F`` alone would not, and no chunk over ``max_rows`` rows when given, each chunk
    a multiple of ``BLOCK_M``. A function of the shape only, so repeated calls reduce in the same order
    (bitwise reproducible)."""
    align = REDUCE_M_ALIGN_INTERP if interpreting() else REDUCE_M_ALIGN_GPU
    f_tiles = cdiv(F, 32 if interpreting() else 128)
    split = max(1, min(cdiv(M, align), _num_programs_target(device) // max(1, f_tiles)))
    if max_rows is not None:
        split = max(split, cdiv(M, max_rows))
    m_per_split = cdiv(cdiv(M, split), align) * align
    return cdiv(M, m_per_split), m_per_split


# (device, stream) -> the fp32 partials / the int32 arrival counters of the launches on that stream: they run
# one after another, and each leaves its counters at zero.
_PARTIALS: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}


def grad_problems(x, g, dy, s_lora) -> tuple:
    """The adapter gradients' two reductions as the kernels take them, from ``x [M, K]``, ``g = G [M, r]``
    (problem a: dA) and ``dy [M, N]``, ``s_lora = S [M, r]`` (problem b: dB), ``None`` for both tensors of a
    gradient not wanted: ``(dA [r, K] | None, dB [N, r] | None, (feat_a, g_a, out_a), (feat_b, g_b, out_b))``
    with fresh outputs. A problem not wanted borrows the other's tensors (the kernels give it no columns)."""
    want_a, want_b = x is not None, dy is not None
    feat_a, g_a = (x, g) if want_a else (dy, s_lora)
    feat_b, g_b = (dy, s_lora) if want_b else (x, g)
    R = g_a.shape[1]
    dev, dtype = feat_a.device, feat_a.dtype
    dA = torch.empty((R, feat_a.shape[1]), device=dev, dtype=dtype) if want_a else None
    dB = torch.empty((feat_b.shape[1], R), device=dev, dtype=dtype) if want_b else None
    return dA, dB, (feat_a, g_a, dA if want_a else dB), (feat_b, g_b, dB if want_b else dA)


def lora_adapter_grads(
    x: torch.Tensor | None,
    g: torch.Tensor | None,
    dy: torch.Tensor | None,
    s_lora: torch.Tensor | None,
    *,
    p: float = 0.0,
    seed: int = 0,
    f_offset: int = 0,
    drop_x: bool = False,
    site: Site | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dA = c * G^T drop(x)`` ``[r, K]`` from ``x [M, K]``, ``g = G [M, r]``, and ``dB = dy^T S`` ``[N, r]``
    from ``dy [M, N]``, ``s_lora = S [M, r]``, in one launch, in the operands' (one) dtype. Pass ``None`` for
    both tensors of a gradient not wanted (it comes back ``None``). ``c = 1/(1-p)`` with ``drop_x`` (the "pre"
    mask of x's columns shifted by ``f_offset``), else 1. ``M == 0`` gives zeros. Inputs are assumed checked
    by the caller, which passes a ``site`` bound to this operand layout (filled here at its first call)."""
    want_a, want_b = x is not None, dy is not None
    dA, dB, (feat_a, g_a, out_a), (feat_b, g_b, out_b) = grad_problems(x, g, dy, s_lora)
    M, R = g_a.shape
    F_A, F_B = out_a.shape[1] if want_a else 0, out_b.shape[0] if want_b else 0
    dev, dtype = feat_a.device, feat_a.dtype
    if M == 0 or F_A + F_B == 0:
        return tuple(None if t is None else t.zero_() for t in (dA, dB))
    hit = site is not None and site.bound is not None
    if hit:
        split, partials, tma = site.info
    else:
        split, m_per_split = split_rows(M, F_A + F_B, dev)
        r_pad = pad_rank(R)
        partials = split * (F_A + F_B) * r_pad
        a_tma = want_a and tma_rows(feat_a)
        b_tma = want_b and tma_rows(feat_b)
        tma = (a_tma or b_tma) and not interpreting()
    if split > 1:
        ws = stream_buffer(_PARTIALS, dev, partials, torch.float32, zeroed=False)
        count = stream_buffer(_COUNTERS, dev, F_A + F_B, torch.int32, zeroed=True)
    else:
        ws, count = out_a, out_a  # never touched with one split
    if tma:
        ensure_allocator()
    seed_lo, seed_hi = split_seed(seed)
    tensors = (feat_a, g_a, out_a, feat_b, g_b, out_b, ws, count)
    runtime = (1.0 / (1.0 - p) if drop_x else 1.0, float(p), seed_lo, seed_hi, int(f_offset))
    if hit:
        site.bound.launch(tensors, runtime)
        return dA, dB
    drop_a = drop_x and want_a
    odd = drop_a and f_offset % 2 == 1

    def build():
        static = (M, F_A, F_B, R, m_per_split, split, *feat_a.stride(), *g_a.stride(), out_a.stride(1),
                  out_a.stride(0), *feat_b.stride(), *g_b.stride(), *out_b.stride(), (F_A + F_B) * r_pad)  # fmt: skip
        consts = {"DROP_A": drop_a, "ODD_OFFSET": odd, "A_TMA": a_tma, "B_TMA": b_tma, "R_PAD": r_pad,
                  **dot_options(dtype)}  # fmt: skip
        return static, lambda meta: (cdiv(F_A, meta["BLOCK_F"]) + cdiv(F_B, meta["BLOCK_F"]), split), consts

    # The outputs are fresh and contiguous, so their strides follow from the sizes.
    signature = (M, F_A, F_B, R, want_a, want_b, feat_a.stride(), g_a.stride(), feat_b.stride(), g_b.stride(), dtype,
                 drop_a, odd, a_tma, b_tma, split > 1)  # fmt: skip
    bound = launch(_SPEC, _lora_adapter_grads_kernel, signature, tensors, runtime, build)
    if site is not None:
        site.info, site.bound = (split, partials, tma), bound
    return dA, dB
