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

**The shrink, fused** (``FUSE_SHRINK``: no "pre" dropout, r <= ``FUSE_MAX_RANK``). The rank-r activation
``s = c * drop_post(x @ u)`` (S = s x A^T in forward, u = A^T; G = s dy B for dx, u = B) needs a whole row of
x, which every output tile of that row block streams through shared memory anyway. So the kernel computes
it instead of a separate shrink launch (a 28 us extra read of x at 8192x4096 on the H200):

- column tile 0 of each row block is its *producer*: one more ``[BLOCK_M, BLOCK_K] x [BLOCK_K, R_PAD]`` dot
  per K step (u tiles through TMA like W's), then it rounds s once, stores it (S / G is saved for the
  adapter gradients) and publishes it by writing the launch's epoch + 1 to the row block's flag (release);
- the other tiles (*consumers*) read the flag before their plain K loop and, after it, load s once the flag
  shows this launch's epoch (a relaxed load and an acquire fence);
- producers come first in the tile order, a wave ahead of their consumers after the first wave, so a
  consumer normally finds s published. It polls at most ``max_spins`` times: a producer whose program is
  not resident (another kernel holds the SMs) must not stall it, so then it computes its rows itself from
  the same tiles in the same order, hence the same bits;
- the last program to finish advances the stream's epoch, so the flags need no reset and the launch no
  host-side state (CUDA-graph safe).

Why this structure (``benchmarks/probe_gemm.py``, H200, bf16, ratio to cuBLAS; NOTES.md has the table): the
bare persistent TMA core runs at 0.95-1.03x; flattening the tile and K loops (``tl.range(flatten=True)``)
is as fast without a rank term but 1.20-1.26x with one in the epilogue, and 2-2.4x with one in the
prologue; unflattened loops with the half-tile store hold the rank term at 0.99-1.06x.

Descriptors need 16-bit operands, unit inner strides and 16-byte aligned rows (``tma_compatible``); the
launcher (``gemm.lora_gemm``) sends everything else to the pointer kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._interp import cdiv, dot_options, interpreting, pad_rank, stream_buffer
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
from .dropout_mask import keep_tile



@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: ``GROUP_M`` row-blocks of tiles share each sweep over the N tiles."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _rank_term(
    acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr, stride_fn,
    R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``acc + s[offs_m, :R] @ f[:R, offs_n]`` in fp32, r in ``BLOCK_R`` chunks (unrolled; a chunk past R
    loads zeros). Pointer loads: the tiles are tiny, and S, B, G, A keep any strides and any r."""
    m_in = offs_m < M
    n_in = offs_n < N_OUT
    rows64 = offs_m[:, None].to(tl.int64)  # M * stride can pass 2**31
    for r0 in tl.static_range(0, R_PAD, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_in = offs_r < R
        s = tl.load(s_ptr + rows64 * stride_sm + offs_r[None, :] * stride_sr, mask=m_in[:, None] & r_in[None, :],
                    other=0.0)  # fmt: skip
        f = tl.load(f_ptr + offs_r[:, None] * stride_fr + offs_n[None, :] * stride_fn,
                    mask=r_in[:, None] & n_in[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            s = s.to(tl.float32)
            f = f.to(tl.float32)
        acc = tl.dot(s, f, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _kn_tile(desc, off_k, off_n, NK: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` operand tile at ``(off_k, off_n)`` of a matrix stored ``[N, K]`` (``NK``: the
    descriptor's block is ``[BLOCK_N, BLOCK_K]``, read transposed) or ``[K, N]``."""
    if NK:
        b = desc.load([off_n, off_k]).T
    else:
        b = desc.load([off_k, off_n])
    return b


@triton.jit
def _k_loop(
    acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + x[rows of pid_m] @ w[:, cols of pid_n]``: the base GEMM's pipelined K loop."""
    for ki in range(k_tiles):
        off_k = ki * BLOCK_K
        a = x_desc.load([pid_m * BLOCK_M, off_k])
        b = _kn_tile(w_desc, off_k, pid_n * BLOCK_N, W_NK)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fused_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """The fused shrink's tile order. Row blocks form groups of ``GROUP_M`` as in ``_tile_coords``; a group's
    producers (its column tile 0s) run one group ahead of its consumers (its other tiles, in grouped order):

        P_0 | P_1 C_0 | P_2 C_1 | ... | P_last C_last-1 | C_last

    so a producer reads its rows about one group (a wave, at N = 16 tiles) before their consumers need s and
    re-read them from L2, and a consumer's producer always has a lower tile id: a program never waits for a
    tile it would only reach later itself."""
    num_groups = tl.cdiv(num_pid_m, GROUP_M)
    last_rows = num_pid_m - (num_groups - 1) * GROUP_M
    first_rows = tl.minimum(num_pid_m, GROUP_M)
    full = GROUP_M * num_pid_n  # a block "P_g+1 C_g" of two whole groups
    q = tile_id - first_rows
    # Blocks 0 .. num_groups - 3 are whole; block num_groups - 2 holds the last group's producers (last_rows of
    # them), and the final block C_last alone starts after it.
    last_start = tl.where(num_groups >= 2, (num_groups - 2) * full + last_rows + GROUP_M * (num_pid_n - 1), 0)
    in_last = q >= last_start
    j = tl.where(in_last, num_groups - 1, q // full)
    r = tl.where(in_last, q - last_start, q - j * full)
    next_rows = tl.where(j + 1 < num_groups - 1, GROUP_M, tl.where(j + 1 == num_groups - 1, last_rows, 0))
    rows = tl.where(j < num_groups - 1, GROUP_M, last_rows)
    c = r - next_rows
    producer = r < next_rows
    pid_m = tl.where(producer, (j + 1) * GROUP_M + r, j * GROUP_M + c % rows)
    pid_n = tl.where(producer, 0, 1 + c // rows)
    pid_m = tl.where(q < 0, tile_id, pid_m)  # P_0
    pid_n = tl.where(q < 0, 0, pid_n)
    return pid_m, pid_n


@triton.jit
def _finish_s(s_acc, offs_m, s_scale, p, seed_lo, seed_hi, R_PAD: tl.constexpr, DROP_POST: tl.constexpr, dtype):
    """``s_scale * drop_post(s_acc)`` rounded once to ``dtype``: the rank-r activation's values, the same
    whether the producer or a consumer computed ``s_acc``."""
    if DROP_POST:
        keep = keep_tile(seed_lo, seed_hi, p, offs_m[:, None], tl.arange(0, R_PAD)[None, :])
        s_acc = tl.where(keep, s_acc, 0.0)
    return (s_acc * s_scale).to(dtype)


@triton.jit
def _shrink_rows(
    x_desc, u_desc, pid_m, k_tiles, U_RK: tl.constexpr, R_PAD: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``x[rows of pid_m] @ u`` (fp32), for a consumer whose producer has not published in time: the producer's
    K loop without the base GEMM, the same tiles in the same order (so the same fp32 values)."""
    s_acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for ki in range(k_tiles):
        a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
        u = _kn_tile(u_desc, ki * BLOCK_K, 0, U_RK)
        if UPCAST:
            a = a.to(tl.float32)
            u = u.to(tl.float32)
        s_acc = tl.dot(a, u, s_acc, input_precision=DOT_PRECISION)
    return s_acc


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "n_offset", "max_spins"])
def _lora_gemm_tma_kernel(
    # pointers
    x_ptr,  # [M, K_RED]     activation (x, or dy), unit inner stride
    w_ptr,  # W [N_OUT, K_RED] when W_NK, else [K_RED, N_OUT]; unit inner stride
    bias_ptr,  # [N_OUT] or a dummy when not HAS_BIAS
    s_ptr,  # [M, R]         rank-r activation (S, or G); written here when FUSE_SHRINK
    f_ptr,  # [R, N_OUT]     rank-r factor (B^T, or A)
    out_ptr,  # [M, N_OUT]   unit inner stride
    u_ptr,  # A [R, K_RED] when U_RK, else B [K_RED, R]: the shrink factor (FUSE_SHRINK), else a dummy
    sync_ptr,  # int32 [epoch, programs arrived, one flag per row block] of this stream (FUSE_SHRINK)
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
    stride_u,
    # runtime scalars (changing them never recompiles)
    keep_scale,
    p,
    seed_lo,
    seed_hi,
    n_offset,
    s_scale,  # the shrink's scale (s, times 1/(1-p) under "post" dropout), FUSE_SHRINK
    max_spins,  # how long a consumer polls for its producer before computing its rows itself
    # compile-time
    W_NK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LORA_DROP: tl.constexpr,
    FUSE_SHRINK: tl.constexpr,
    DROP_POST: tl.constexpr,
    U_RK: tl.constexpr,
    FENCE: tl.constexpr,
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
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K_RED], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N_OUT, K_RED], [stride_w, 1], [BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K_RED, N_OUT], [stride_w, 1], [BLOCK_K, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, N_OUT], [stride_om, 1], [BLOCK_M, BLOCK_N // 2])
    if FUSE_SHRINK:
        # The shrink factor's tiles move like W's, through the pipeline (zeros past R and K_RED).
        if U_RK:
            u_desc = tl.make_tensor_descriptor(u_ptr, [R, K_RED], [stride_u, 1], [R_PAD, BLOCK_K])
        else:
            u_desc = tl.make_tensor_descriptor(u_ptr, [K_RED, R], [stride_u, 1], [BLOCK_K, R_PAD])

    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    k_tiles = tl.cdiv(K_RED, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n

    if FUSE_SHRINK:
        # This launch's producers publish s by writing ``epoch + 1`` to their row block's flag; the last program
        # to finish advances the epoch. So flags need no reset and carry no host-side state (CUDA-graph safe).
        epoch = tl.load(sync_ptr)
        published = epoch + 1
        flag_ptr = sync_ptr + 2

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS):
        if FUSE_SHRINK:
            pid_m, pid_n = _fused_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        else:
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FUSE_SHRINK:
            # The rank-r activation s = s_scale * drop_post(x @ u) is computed here, not by a shrink launch:
            # column tile 0 of each row block (the producer) runs it beside the base GEMM in its K loop (one
            # more [BLOCK_M, BLOCK_K] x [BLOCK_K, R_PAD] dot on x tiles already in shared memory), stores it
            # and publishes it; the row block's other tiles (consumers) read it after their own K loop.
            if pid_n == 0:
                s_acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
                for ki in range(k_tiles):
                    off_k = ki * BLOCK_K
                    a = x_desc.load([pid_m * BLOCK_M, off_k])
                    b = _kn_tile(w_desc, off_k, pid_n * BLOCK_N, W_NK)
                    u = _kn_tile(u_desc, off_k, 0, U_RK)
                    if UPCAST:
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                        u = u.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                    s_acc = tl.dot(a, u, s_acc, input_precision=DOT_PRECISION)
                s = _finish_s(s_acc, offs_m, s_scale, p, seed_lo, seed_hi, R_PAD, DROP_POST, s_ptr.dtype.element_ty)
                offs_r = tl.arange(0, R_PAD)
                s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_r[None, :] * stride_sr
                tl.store(s_ptrs, s, mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))
                # Every thread's stores happen before one thread's release-ordered publication.
                tl.debug_barrier()
                tl.atomic_xchg(flag_ptr + pid_m, published, sem="release", scope="gpu")
            else:
                # The flag is read before the K loop (a plain load: nothing waits for it until after the loop,
                # where the producer, a wave ahead, has normally published).
                seen = tl.load(flag_ptr + pid_m, volatile=True)
                acc = _k_loop(acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK, UPCAST, DOT_PRECISION, BLOCK_M,
                              BLOCK_N, BLOCK_K)  # fmt: skip
                # Poll, but never unboundedly: a producer whose program is not resident (another kernel holds
                # the SMs) must not stall this one, so after ``max_spins`` polls the consumer computes its rows
                # itself, from the same tiles in the same order, hence the same values.
                spins = 0
                while (seen != published) & (spins < max_spins):
                    seen = tl.load(flag_ptr + pid_m, volatile=True)
                    spins += 1
                if seen == published:
                    if FENCE:
                        # The relaxed load that saw the release, then an acquire fence: the acquire pattern
                        # of the PTX memory model, which orders the loads of s after the producer's stores.
                        seen = tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [seen],
                                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
                    offs_r = tl.arange(0, R_PAD)
                    s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_r[None, :] * stride_sr
                    # .cg: read at L2, where the producer's stores landed.
                    s = tl.load(s_ptrs, mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                else:
                    s_acc = _shrink_rows(x_desc, u_desc, pid_m, k_tiles, U_RK, R_PAD, UPCAST, DOT_PRECISION,
                                         BLOCK_M, BLOCK_K)  # fmt: skip
                    s = _finish_s(s_acc, offs_m, s_scale, p, seed_lo, seed_hi, R_PAD, DROP_POST,
                                  s_ptr.dtype.element_ty)  # fmt: skip
            f = tl.load(f_ptr + tl.arange(0, R_PAD)[:, None] * stride_fr + offs_n[None, :] * stride_fn,
                        mask=(tl.arange(0, R_PAD)[:, None] < R) & (offs_n[None, :] < N_OUT), other=0.0)  # fmt: skip
            if UPCAST:
                s = s.to(tl.float32)
                f = f.to(tl.float32)
            acc = tl.dot(s, f, acc, input_precision=DOT_PRECISION)
        else:
            if LORA_DROP:
                # dx under "pre" dropout: the mask belongs to the LoRA term alone, so that term goes first and
                # is masked before the K loop adds into the same accumulator (a second fp32 tile would spill).
                acc = _rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                                 stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION)  # fmt: skip
                keep = keep_tile(seed_lo, seed_hi, p, offs_m[:, None], n_offset + offs_n[None, :])
                acc = tl.where(keep, acc * keep_scale, 0.0)
            acc = _k_loop(acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K)  # fmt: skip
            if not LORA_DROP:
                acc = _rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                                 stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION)  # fmt: skip
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N_OUT, other=0.0)
            acc += bias[None, :].to(tl.float32)
        # Stored as two half-width tiles: half the shared-memory staging of one full-tile TMA store.
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(out_ptr.dtype.element_ty))
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(out_ptr.dtype.element_ty))

    if FUSE_SHRINK:
        # Every program read the epoch before arriving here; the last to arrive advances it for the next launch.
        arrived = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr, published, sem="relaxed", scope="gpu")


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


def stored(t: torch.Tensor) -> torch.Tensor:
    """A 2-D operand in the orientation it is stored in (row-major): ``t`` itself, or ``t.t()`` for the
    transposed view of a row-major tensor (``W.t()``, ``A.t()``)."""
    return t.t() if t.stride(0) == 1 and t.stride(1) != 1 else t


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
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        # Allocated on the current stream, which is ``stream``: the caching allocator reuses it in order.
        buf = _SCRATCH[key] = torch.empty(max(size, 1 << 16), device="cuda", dtype=torch.int8)
    return buf


def ensure_allocator() -> None:
    # Triton keeps its allocator in a ContextVar: autograd's device threads start with the default (none),
    # so the check runs at every launch, in the launching thread. A user's own allocator is left alone.
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


# The largest rank the GEMM computes its rank-r activation for (``FUSE_SHRINK``): the producer's fp32 ``[BLOCK_M,
# R_PAD]`` accumulator and ``u`` tiles ride beside the 128x256 tile's, within registers and 227 KB of shared
# memory up to R_PAD = 32; larger ranks take the separate shrink launch.
FUSE_MAX_RANK = 32
# Polls of a consumer for its producer before it computes the rows itself: a few ms of L2 atomics, far longer
# than a producer runs ahead; only a producer whose program is not resident yet waits that long.
MAX_SPINS_GPU = 1 << 14
# Programs of the persistent grid in the interpreter, which runs them one after another: with two, the first
# program's consumers of row blocks whose producer is the second's compute their rows themselves, so the CPU
# tests cover both ways a consumer gets its rows.
INTERP_PROGRAMS = 2


# (device, stream) -> the fused shrink's int32 sync words ``[epoch, programs arrived, one flag per row block]``
# of the launches on that stream (one after another, each leaving the arrival count at zero). Sized for row
# blocks of 16 rows, the smallest BLOCK_M any config could take; a new buffer starts at epoch 0, all flags 0.
_SYNC: dict[tuple, torch.Tensor] = {}


def lora_gemm_tma(
    x: torch.Tensor,
    w: torch.Tensor,
    w_nk: bool,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    f: torch.Tensor,
    out: torch.Tensor,
    u: torch.Tensor | None,
    runtime: tuple,
    *,
    lora_drop: bool,
    drop_post: bool,
    site=None,
) -> Bound:
    """Fill ``out [M, N_out]`` with ``x @ (w.T if w_nk else w) (+ bias) + drop(s @ f)``; operands checked by
    ``tma_compatible`` and the caller (``gemm.lora_gemm``), which gives the ``runtime`` scalars (``keep_scale,
    p, seed_lo, seed_hi, n_offset, s_scale``). With ``u [K_red, r]`` (B, or A.t(): ``tma_rows`` in its stored
    orientation) the kernel also computes
    ``s = s_scale * drop_post(x @ u)`` into ``s`` (``FUSE_SHRINK``). Launches the ``site``'s bound kernel when it
    has one, else binds one (and stores it in ``site``)."""
    M, K_red = x.shape
    R = s.shape[1]
    fuse = u is not None
    # u is read like w, through whichever orientation has the unit stride: A [r, K] (passed as A.t()) or B.
    u_rk = fuse and u.stride(0) == 1 and u.stride(1) != 1
    if not interpreting():
        ensure_allocator()
    sync = stream_buffer(_SYNC, x.device, 2 + cdiv(M, 16), torch.int32, zeroed=True) if fuse else out
    tensors = (x, w, bias if bias is not None else out, s, f, out, u if fuse else out, sync)
    # The interpreter runs programs one after another: a consumer polling a later program's producer would
    # wait forever, so there it computes unpublished rows at once (which the CPU tests thereby cover).
    runtime = (*runtime, 0 if interpreting() else MAX_SPINS_GPU)
    if site is not None and site.bound is not None:
        site.bound.launch(tensors, runtime)
        return site.bound
    N_out = out.shape[1]
    num_sms = INTERP_PROGRAMS if interpreting() else sm_count(x.device.index or 0)

    stride_u = (u.stride(1) if u_rk else u.stride(0)) if fuse else 0

    def build():
        static = (M, N_out, K_red, R, x.stride(0), w.stride(0), *s.stride(), *f.stride(), out.stride(0),
                  bias.stride(0) if bias is not None else 0, stride_u)  # fmt: skip
        r_pad = pad_rank(R)
        consts = {
            "W_NK": w_nk,
            "HAS_BIAS": bias is not None,
            "LORA_DROP": lora_drop,
            "FUSE_SHRINK": fuse,
            "DROP_POST": drop_post,
            "U_RK": u_rk,
            # The interpreter runs programs one after another (nothing to order) and has no inline PTX.
            "FENCE": fuse and not interpreting(),
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
                 s.stride(), f.stride(), fuse and u.stride(), drop_post, x.dtype, lora_drop, num_sms)  # fmt: skip
    bound = launch(_SPEC, _lora_gemm_tma_kernel, signature, tensors, runtime, build)
    if site is not None:
        site.bound = bound
    return bound
