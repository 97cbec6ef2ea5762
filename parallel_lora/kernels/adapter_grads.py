"""Both adapter gradients in one launch, as reductions over M in a fixed order: ``out [F, r] = c * drop(feat)^T @ g``
for ``dA = G^T drop_pre(x) [r, K]`` (stored through transposed strides) and ``dB = dy^T S [N, r]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import reduce_item
from .dropout_mask import mask_keys
from .gemm_tma import tma_rows
from .host import aligned_pieces, cdiv, dot_options, interpreting, keep_scale, next_pow2, pad_rank, seed_arg
from .launcher import Site, launch, output, site_buffers, site_info
from .spec import KernelSpec
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import COUNTERS, PARTIALS, stream_buffer

# fmt: off


def reduce_configs() -> list[triton.Config]:
    """The reductions' configs (BLOCK_F, BLOCK_M, stages, warps)."""
    rows = [
        (32, 32, 2, 4),
        (64, 64, 4, 4),
        (64, 128, 3, 4),
        (64, 128, 4, 4),
        (128, 64, 3, 4),
        (128, 64, 4, 8),
        (128, 128, 3, 8),
        (256, 64, 3, 8),
    ]
    return [triton.Config({"BLOCK_F": bf, "BLOCK_M": bm}, num_stages=s, num_warps=w) for bf, bm, s, w in rows]


def reduce_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    return stages * cfg["BLOCK_M"] * (cfg["BLOCK_F"] + consts["R_PAD"]) * elem + ATOMIC_SLOT


def reduce_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_F"] <= max(64, next_pow2(max(nargs["F_A"], nargs["F_B"])))


# Every split is a whole number of M tiles for every config: the largest BLOCK_M (GPU, interpreter).
REDUCE_M_ALIGN_GPU = 128
REDUCE_M_ALIGN_INTERP = 32


@triton.jit(do_not_specialize=["seed_salt", "f_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_adapter_grads_kernel(
    fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
    M, F_A, F_B, R, m_per_split, num_splits,
    stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf, stride_oar,
    stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws,
    scale_a, p, seed_ptr, seed_salt: tl.int64, f_offset,
    DROP_A: tl.constexpr, ODD_OFFSET: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Problem a (dA: x, G) and b (dB: dy, S); ``F_A = 0`` or ``F_B = 0`` skips that gradient."""
    k_row, k_col = mask_keys(seed_ptr, seed_salt, DROP_A)
    reduce_item(
        tl.program_id(0), tl.program_id(1), fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
        M, F_A, F_B, R, m_per_split, num_splits, stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf,
        stride_oar, stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws, scale_a, p,
        k_row, k_col, f_offset, DROP_A, ODD_OFFSET, A_TMA, B_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M,
        None,
    )


SPEC = KernelSpec(
    name="adapter_grads",
    configs=reduce_configs,
    key=("M", "F_A", "F_B", "R"),
    smem=reduce_smem,
    work=lambda n: n["M"] * (n["F_A"] + n["F_B"]) * n["R"],
    fits=reduce_fits,
    dtype_arg="fa_ptr",
    interp={"BLOCK_F": 32, "BLOCK_M": 32},
    descriptors=lambda consts: consts["A_TMA"] or consts["B_TMA"],
)


def _num_programs_target(device: torch.device) -> int:
    if interpreting():
        return 8
    return 2 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_rows(M: int, F: int, device: torch.device, max_rows: int | None = None) -> tuple[int, int]:
    """``(split, m_per_split)`` of the M reduction over ``F`` columns: enough programs to fill the device, chunks
    of at most ``max_rows``; a function of the shape only."""
    align = REDUCE_M_ALIGN_INTERP if interpreting() else REDUCE_M_ALIGN_GPU
    f_tiles = cdiv(F, 32 if interpreting() else 128)
    split = max(1, min(cdiv(M, align), _num_programs_target(device) // max(1, f_tiles)))
    if max_rows is not None:
        split = max(split, cdiv(M, max_rows))
    return aligned_pieces(M, split, align)


def partials_workspace(
    M: int, F: int, R: int, device: torch.device, max_rows: int | None = None
) -> tuple[int, int, int]:
    """``(split, m_per_split, fp32 partials' elements)`` of ``F`` columns' reductions over M."""
    split, m_per_split = split_rows(M, F, device, max_rows)
    return split, m_per_split, split * F * pad_rank(R)


def split_buffers(device: torch.device, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split reductions' fp32 ``partials`` and their column ``counters``."""
    return (stream_buffer(PARTIALS, device, partials, torch.float32, zeroed=False),
            stream_buffer(COUNTERS, device, counters, torch.int32, zeroed=True))  # fmt: skip


Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (feat, g, out) of one reduction


def grad_problems(
    x: torch.Tensor | None, g: torch.Tensor | None, dy: torch.Tensor | None, s_lora: torch.Tensor | None,
    like: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, Problem, Problem]:
    """``(dA | None, dB | None, problem a, problem b)`` with fresh outputs in ``like``'s dtype (None: the features');
    a gradient not wanted (its two tensors ``None``) borrows the other's tensors and gets no columns."""
    want_a, want_b = x is not None, dy is not None
    feat_a, g_a = (x, g) if want_a else (dy, s_lora)
    feat_b, g_b = (dy, s_lora) if want_b else (x, g)
    R, like = g_a.shape[1], feat_a if like is None else like
    dA = output(like, R, feat_a.shape[1]) if want_a else None
    dB = output(like, feat_b.shape[1], R) if want_b else None
    return dA, dB, (feat_a, g_a, dA if want_a else dB), (feat_b, g_b, dB if want_b else dA)


def lora_adapter_grads(
    x: torch.Tensor | None,
    g: torch.Tensor | None,
    dy: torch.Tensor | None,
    s_lora: torch.Tensor | None,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    f_offset: int = 0,
    drop_x: bool = False,
    like: torch.Tensor | None = None,
    site: Site | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dA [r, K], dB [N, r])`` in ``like``'s dtype (None: x's or dy's): ``dA = c * G^T drop(x)`` (``c = 1/(1-p)``
    with ``drop_x``, the "pre" mask at columns ``f_offset + k``), ``dB = dy^T S``; ``None`` in, ``None`` out;
    ``M == 0`` gives zeros."""
    want_a, want_b = x is not None, dy is not None
    dA, dB, (feat_a, g_a, out_a), (feat_b, g_b, out_b) = grad_problems(x, g, dy, s_lora, like)
    M, R = g_a.shape
    F_A, F_B = out_a.shape[1] if want_a else 0, out_b.shape[0] if want_b else 0
    dev = feat_a.device
    if M == 0 or F_A + F_B == 0:
        return tuple(None if t is None else t.zero_() for t in (dA, dB))
    info = site_info(site, partials_workspace, M, F_A + F_B, R, dev)
    split, m_per_split, partials = info
    # never touched with one split
    ws, count = site_buffers(site, dev, split_buffers, dev, partials, F_A + F_B) if split > 1 else (out_a, out_a)
    tensors = (feat_a, g_a, out_a, feat_b, g_b, out_b, ws, count)
    runtime = (keep_scale(p, drop_x), float(p), *seed_arg(seed, feat_a), int(f_offset))
    launch(site, tensors, runtime, _describe, tensors, want_a, want_b, split, m_per_split, drop_x, f_offset, info=info)
    return dA, dB


def _describe(tensors: tuple, want_a: bool, want_b: bool, split: int, m_per_split: int, drop_x: bool, f_offset: int):
    feat_a, g_a, out_a, feat_b, g_b, out_b, _, _ = tensors
    M, R = g_a.shape
    F_A, F_B = out_a.shape[1] if want_a else 0, out_b.shape[0] if want_b else 0
    r_pad = pad_rank(R)
    drop_a = drop_x and want_a
    odd = drop_a and f_offset % 2 == 1
    a_tma = want_a and tma_rows(feat_a)
    b_tma = want_b and tma_rows(feat_b)

    def build():
        static = (M, F_A, F_B, R, m_per_split, split, *feat_a.stride(), *g_a.stride(), out_a.stride(1),
                  out_a.stride(0), *feat_b.stride(), *g_b.stride(), *out_b.stride(), (F_A + F_B) * r_pad)
        consts = {"DROP_A": drop_a, "ODD_OFFSET": odd, "A_TMA": a_tma, "B_TMA": b_tma, "R_PAD": r_pad,
                  **dot_options(feat_a.dtype)}
        return static, lambda meta: (cdiv(F_A, meta["BLOCK_F"]) + cdiv(F_B, meta["BLOCK_F"]), split), consts

    # The outputs are fresh and contiguous, so their strides follow from the sizes.
    signature = (M, F_A, F_B, R, want_a, want_b, feat_a.stride(), g_a.stride(), feat_b.stride(), g_b.stride(),
                 feat_a.dtype, out_a.dtype, drop_a, odd, a_tma, b_tma, split > 1)
    return SPEC, _lora_adapter_grads_kernel, signature, build
