"""The Hopper path of the LoRA GEMM: a persistent, TMA-fed GEMM with the rank-r term in its epilogue.

    out[M, N_out] = x[M, K_red] @ w (+ bias) + c * drop(s[M, r] @ f[r, N_out])

    forward  y  = x  W^T + b + S B^T     w = W [N, K] read as [BLOCK_N, BLOCK_K] tiles (W_NK)
    backward dx = dy W + drop_pre(G A)   w = W [N, K] read as [BLOCK_K, BLOCK_N] tiles (the same W, no copy)

Same math and arguments as ``gemm._lora_gemm_kernel`` (the portable pointer kernel); what changes is how
the tiles move. ``NUM_SMS`` programs walk the output tiles in grouped order (``GROUP_M`` row-blocks sweep
the N tiles together, so the ``w`` panel stays in L2), and every x / w / out tile moves through a device-side
TMA descriptor (``tl.make_tensor_descriptor``): bulk copies into swizzled shared memory feeding wgmma, with
out-of-bounds rows and columns zero-filled on load and clipped on store, so M, N and K tails need no masks.
The output leaves as two half-width tiles (half the shared-memory staging).

The rank-r term goes into the same fp32 accumulator, ``acc += s_tile @ f_tile`` (r in ``BLOCK_R`` chunks),
after the K loop; for dx under "pre" dropout it goes first, masked (columns ``n_offset + n``) and scaled by
``1/(1-p)``, and the K loop then accumulates onto it, so the mask touches the LoRA term alone without a
second accumulator tile.

Why this structure (``benchmarks/probe_gemm.py``, H200, bf16, ratio to cuBLAS; NOTES.md has the table): the
bare persistent TMA core runs at 0.95-1.03x; flattening the tile and K loops (``tl.range(flatten=True)``)
is as fast without a rank term but 1.20-1.26x with one in the epilogue read through pointers, and 2-2.4x
with one in the prologue; unflattened loops with the half-tile store hold the rank term at 0.99-1.06x.
With the rank tiles read through TMA descriptors instead, the flattened loops win (session 26, H100, 8192 x
4096 -> 4096: 4-7 us a GEMM in the probe, 2-3 us in the backward's fused launch), so ``gemm_tiles`` takes them
wherever the rank tiles can be described (``rank_tma``) and the rank term comes last.

Descriptors need 16-bit operands, unit inner strides and 16-byte aligned rows (``tma_compatible``); the
launcher (``gemm.lora_gemm``) sends everything else to the pointer kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._interp import cdiv, dot_options, grown, interpreting, pad_rank
from .configs import (
    GEMM_KEY,
    MAX_BLOCK_R,
    Bound,
    KernelSpec,
    gemm_fits,
    gemm_tma_configs,
    gemm_tma_smem,
    gemm_work,
    launch,
    sm_count,
)
from .dropout_mask import drop_tile


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: ``GROUP_M`` row-blocks of tiles share each sweep over the N tiles."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def rank_term(
    acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr, stride_fn,
    R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    S_CACHE: tl.constexpr,
):  # fmt: skip
    """``acc + s[offs_m, :R] @ f[:R, offs_n]`` in fp32, r in ``BLOCK_R`` chunks (unrolled; a chunk past R
    loads zeros). Pointer loads: the tiles are tiny, and S, B, G, A keep any strides and any r. ``S_CACHE``:
    the loads' cache modifier for s (".cg" reads s at L2, where another program of this launch wrote it)."""
    m_in = offs_m < M
    n_in = offs_n < N_OUT
    rows64 = offs_m[:, None].to(tl.int64)  # M * stride can pass 2**31
    for r0 in tl.static_range(0, R_PAD, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_in = offs_r < R
        s = tl.load(s_ptr + rows64 * stride_sm + offs_r[None, :] * stride_sr, mask=m_in[:, None] & r_in[None, :],
                    other=0.0, cache_modifier=S_CACHE)  # fmt: skip
        f = tl.load(f_ptr + offs_r[:, None] * stride_fr + offs_n[None, :] * stride_fn,
                    mask=r_in[:, None] & n_in[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            s = s.to(tl.float32)
            f = f.to(tl.float32)
        acc = tl.dot(s, f, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def tile_dot(
    acc, a_desc, b_desc, pid_m, pid_n, off, B_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``acc + a[tile rows, off:off + step] @ b[off:off + step, tile columns]``, one step of a tile's reduction
    through TMA descriptors: b's tile read as ``[BLOCK_N, step]`` and transposed (``B_T``), or as
    ``[step, BLOCK_N]``."""
    a = a_desc.load([pid_m * BLOCK_M, off])
    if B_T:
        b = b_desc.load([pid_n * BLOCK_N, off]).T
    else:
        b = b_desc.load([off, pid_n * BLOCK_N])
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def rank_descriptors(
    s_ptr, f_ptr, M, N_OUT, R, stride_sm, stride_fr, stride_fn, F_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The TMA descriptors of s's ``[BLOCK_M, BLOCK_R]`` tiles and f's: ``[BLOCK_N, BLOCK_R]`` tiles of ``f^T``
    (``F_T``: B [N, r] for y) or ``[BLOCK_R, BLOCK_N]`` tiles of f (A [r, K] for dx). Columns past R read zeros."""
    s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [stride_sm, 1], [BLOCK_M, BLOCK_R])
    if F_T:
        f_desc = tl.make_tensor_descriptor(f_ptr, [N_OUT, R], [stride_fn, 1], [BLOCK_N, BLOCK_R])
    else:
        f_desc = tl.make_tensor_descriptor(f_ptr, [R, N_OUT], [stride_fr, 1], [BLOCK_R, BLOCK_N])
    return s_desc, f_desc


@triton.jit
def gemm_descriptors(
    x_ptr, w_ptr, out_ptr, M, N_OUT, K_RED, stride_xm, stride_w, stride_om, W_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The TMA descriptors of x's ``[BLOCK_M, BLOCK_K]`` tiles, w's tiles (``[BLOCK_N, BLOCK_K]`` of W when
    ``W_NK``, else ``[BLOCK_K, BLOCK_N]``) and out's half-width ``[BLOCK_M, BLOCK_N // 2]`` tiles."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K_RED], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N_OUT, K_RED], [stride_w, 1], [BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K_RED, N_OUT], [stride_w, 1], [BLOCK_K, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, N_OUT], [stride_om, 1], [BLOCK_M, BLOCK_N // 2])
    return x_desc, w_desc, out_desc


@triton.jit
def k_loop(
    acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + x[tile rows, :] @ w[:, tile columns]``: the pipelined K loop of one output tile."""
    for ki in range(k_tiles):
        acc = tile_dot(acc, x_desc, w_desc, pid_m, pid_n, ki * BLOCK_K, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N)
    return acc


@triton.jit
def store_tile(
    acc, out_desc, out_ptr, bias_ptr, pid_m, pid_n, offs_n, N_OUT, stride_bias, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Add the bias and store the tile through ``out_desc``, rounded once to ``out_ptr``'s dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N_OUT, other=0.0)
        acc += bias[None, :].to(tl.float32)
    # Stored as two half-width tiles: half the shared-memory staging of one full-tile TMA store.
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    left, right = tl.split(halves)
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(out_ptr.dtype.element_ty))
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(out_ptr.dtype.element_ty))


@triton.jit
def gemm_tiles(
    x_ptr, w_ptr, bias_ptr, s_ptr, f_ptr, out_ptr, M, N_OUT, K_RED, R,
    stride_xm, stride_w, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
    keep_scale, p, seed_lo, seed_hi, n_offset, first_tile, tile_step,
    W_NK: tl.constexpr, HAS_BIAS: tl.constexpr, LORA_DROP: tl.constexpr, ODD_OFFSET: tl.constexpr,
    RANK_TMA: tl.constexpr, F_T: tl.constexpr, R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """The output tiles ``first_tile, first_tile + tile_step, ...`` (grouped order) of the LoRA GEMM: the
    persistent loop of one program. Shared by ``_lora_gemm_tma_kernel`` and the backward's fused launch.

    With ``RANK_TMA`` (``rank_tma``; never with ``LORA_DROP``) the rank tiles come through TMA descriptors and
    the tile and K loops are flattened into one software pipeline, so a tile's first loads are in flight while
    the previous tile's rank term and store run (NOTES.md, session 26). Otherwise each tile's K loop starts on
    an empty pipeline."""
    x_desc, w_desc, out_desc = gemm_descriptors(x_ptr, w_ptr, out_ptr, M, N_OUT, K_RED, stride_xm, stride_w,
                                                stride_om, W_NK, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    if RANK_TMA:
        s_desc, f_desc = rank_descriptors(s_ptr, f_ptr, M, N_OUT, R, stride_sm, stride_fr, stride_fn, F_T, BLOCK_M,
                                          BLOCK_N, BLOCK_R)  # fmt: skip

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    k_tiles = tl.cdiv(K_RED, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n

    # The epilogue takes its tile from its own counter: in the flattened pipeline the loop's coordinates
    # may already be the next tile's, whose loads are issued ahead.
    tile_out = first_tile - tile_step
    for tile_id in tl.range(first_tile, num_tiles, tile_step, flatten=RANK_TMA):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA_DROP:
            # dx under "pre" dropout: the mask belongs to the LoRA term alone, so that term goes first and
            # is masked before the K loop adds into the same accumulator (a second fp32 tile would spill).
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                             stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, "")  # fmt: skip
            acc = drop_tile(acc * keep_scale, seed_lo, seed_hi, p, offs_m, n_offset + pid_n * BLOCK_N, ODD_OFFSET)
        acc = k_loop(acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_out += tile_step
        pid_m, pid_n = tile_coords(tile_out, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if RANK_TMA:
            # The whole rank in one step (``rank_tma``: R_PAD == BLOCK_R); through descriptors, which is what
            # lets the loops be flattened (pointer loads here ran 1.2x cuBLAS, NOTES.md, session 2).
            acc = tile_dot(acc, s_desc, f_desc, pid_m, pid_n, 0, F_T, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N)
        elif not LORA_DROP:
            acc = rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                             stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, "")  # fmt: skip
        store_tile(acc, out_desc, out_ptr, bias_ptr, pid_m, pid_n, offs_n, N_OUT, stride_bias, HAS_BIAS, BLOCK_M,
                   BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "n_offset"])
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
    seed_lo,
    seed_hi,
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
    gemm_tiles(
        x_ptr, w_ptr, bias_ptr, s_ptr, f_ptr, out_ptr, M, N_OUT, K_RED, R,
        stride_xm, stride_w, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
        keep_scale, p, seed_lo, seed_hi, n_offset, tl.program_id(0), NUM_SMS,
        W_NK, HAS_BIAS, LORA_DROP, ODD_OFFSET, RANK_TMA, F_T, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M,
    )  # fmt: skip


_SPEC = KernelSpec(
    name="gemm_tma",
    configs=gemm_tma_configs,
    key=GEMM_KEY,
    smem=gemm_tma_smem,
    work=gemm_work,
    fits=gemm_fits,
    dtype_arg="x_ptr",
)

_TMA_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _device_has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_rows(t: torch.Tensor) -> bool:
    """Whether the 2-D operand ``t`` can be read through a TMA descriptor: a 16-bit dtype on a Hopper-or-newer
    GPU (or in the interpreter) with describable rows (unit inner stride, 16-byte aligned base and rows)."""
    if t.dtype not in _TMA_DTYPES:
        return False
    # Asked several times per fwd+bwd: ``is_cuda`` / ``get_device()`` avoid building torch.device objects.
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
    goes first (a flattened loop with the rank term before the K loop ran at 2x cuBLAS, NOTES.md, session 2); not
    for a rank whose rows are not 16-byte aligned (r = 4 in 16-bit); and not above one ``MAX_BLOCK_R`` chunk, where
    each chunk's tiles took shared memory of their own (r = 128: 327736 B compiled for sm_90a). Those keep pointer
    loads."""
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


# (device, stream) -> the descriptor workspace of the kernels launched on that stream.
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side descriptors live in a global workspace that Triton asks for at every launch. Kernels on one
    # stream run one after another and each writes its descriptors before reading them, so one workspace per
    # stream serves them all: a fresh ``torch.empty`` per launch cost 2-15 us of host time on the H200
    # machine (the most on autograd's device thread), more than some of these kernels run for.
    if stream is None:
        return torch.empty(size, device="cuda", dtype=torch.int8)
    # Allocated on the current stream, which is ``stream``: the caching allocator reuses it in order. A
    # replaced one is kept (``_interp.grown``): a captured CUDA graph may still write descriptors there.
    key = (torch.cuda.current_device(), stream)
    return grown(_SCRATCH, key, size, lambda n: torch.empty(max(n, 1 << 16), device="cuda", dtype=torch.int8))


def ensure_allocator() -> None:
    # Triton keeps its allocator in a ContextVar: autograd's device threads start with the default (none),
    # so the check runs at every launch, in the launching thread. A user's own allocator is left alone.
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def lora_gemm_tma(
    x: torch.Tensor,
    w: torch.Tensor,
    w_nk: bool,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    f: torch.Tensor,
    out: torch.Tensor,
    tensors: tuple,
    runtime: tuple,
    *,
    lora_drop: bool,
    odd_offset: bool,
) -> Bound:
    """Fill ``out [M, N_out]`` with ``x @ (w.T if w_nk else w) (+ bias) + drop(s @ f)``; operands checked by
    ``tma_compatible`` and the caller (``gemm.lora_gemm``), which also gives the launch's pointer arguments
    ``tensors`` and ``runtime`` scalars (``keep_scale, p, seed_lo, seed_hi, n_offset``). Returns the Bound."""
    M, K_red = x.shape
    N_out = out.shape[1]
    R = s.shape[1]
    num_sms = 2 if interpreting() else sm_count(x.device.index or 0)
    if not interpreting():
        ensure_allocator()

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
    return launch(_SPEC, _lora_gemm_tma_kernel, signature, tensors, runtime, build)
