"""``@triton.jit`` blocks shared by several kernels: the persistent TMA GEMM's tile loop, the shrink's rows and the
M reductions of the adapter gradients. Every block accumulates in fp32; callers round once, at the store."""

from __future__ import annotations

import triton
import triton.language as tl

from .dropout_mask import drop_tile

# fmt: off


@triton.jit
def as_operand(t, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """An adapter tile (fp32 masters, say) rounded to the dot's ``dtype``, to nearest even; held in fp32 under
    ``UPCAST``, rounded by hand where the interpreter would truncate fp32 to bf16."""
    if UPCAST and dtype == tl.bfloat16 and t.dtype == tl.float32:
        bits = t.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return t.to(dtype)


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
def tile_dot(
    acc, a_desc, b_desc, pid_m, pid_n, off, B_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``acc + a[tile rows, off:off + step] @ b[off:off + step, tile columns]`` through TMA descriptors (``B_T``:
    b's tile read as ``[BLOCK_N, step]`` and transposed)."""
    a = a_desc.load([pid_m * BLOCK_M, off])
    if B_T:
        b = b_desc.load([pid_n * BLOCK_N, off]).T
    else:
        b = b_desc.load([off, pid_n * BLOCK_N])
    b = as_operand(b, a.dtype, UPCAST)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def gemm_descriptors(
    x_ptr, w_ptr, out_ptr, M, N_OUT, K_RED, stride_xm, stride_w, stride_om, W_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """TMA descriptors of x's, w's (``[BLOCK_N, BLOCK_K]`` when ``W_NK``) and out's half-width tiles."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K_RED], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N_OUT, K_RED], [stride_w, 1], [BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K_RED, N_OUT], [stride_w, 1], [BLOCK_K, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, N_OUT], [stride_om, 1], [BLOCK_M, BLOCK_N // 2])
    return x_desc, w_desc, out_desc


@triton.jit
def rank_descriptors(
    s_ptr, f_ptr, M, N_OUT, R, stride_sm, stride_fr, stride_fn, F_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """TMA descriptors of s's and f's rank tiles (``F_T``: f read as ``f^T``'s rows); columns past R read zeros."""
    s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [stride_sm, 1], [BLOCK_M, BLOCK_R])
    if F_T:
        f_desc = tl.make_tensor_descriptor(f_ptr, [N_OUT, R], [stride_fn, 1], [BLOCK_N, BLOCK_R])
    else:
        f_desc = tl.make_tensor_descriptor(f_ptr, [R, N_OUT], [stride_fr, 1], [BLOCK_R, BLOCK_N])
    return s_desc, f_desc


@triton.jit
def k_loop(
    acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``acc + x[tile rows, :] @ w[:, tile columns]``: the pipelined K loop of one output tile."""
    for ki in range(k_tiles):
        acc = tile_dot(acc, x_desc, w_desc, pid_m, pid_n, ki * BLOCK_K, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N)
    return acc


@triton.jit
def rank_term(
    acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr, stride_fn,
    R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    S_CACHE: tl.constexpr,
):
    """``acc + s[offs_m, :R] @ f[:R, offs_n]`` in fp32 through pointers (any strides), r in ``BLOCK_R`` chunks;
    ``S_CACHE`` is s's cache modifier (".cg" where another program of this launch wrote s)."""
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
        f = as_operand(f, s.dtype, UPCAST)
        if UPCAST:
            s = s.to(tl.float32)
            f = f.to(tl.float32)
        acc = tl.dot(s, f, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def store_tile(
    acc, out_desc, out_ptr, bias_ptr, pid_m, pid_n, offs_n, N_OUT, stride_bias, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Add the bias and store the tile through ``out_desc``, rounded once to ``out_ptr``'s dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N_OUT, other=0.0)
        acc += bias[None, :].to(tl.float32)
    # Two half-width stores: half the shared-memory staging of one full-tile TMA store.
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    left, right = tl.split(halves)
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(out_ptr.dtype.element_ty))
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(out_ptr.dtype.element_ty))


@triton.jit
def gemm_tiles(
    x_ptr, w_ptr, bias_ptr, s_ptr, f_ptr, out_ptr, M, N_OUT, K_RED, R,
    stride_xm, stride_w, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
    keep_scale, p, k_row, k_col, n_offset, first_tile, tile_step,
    W_NK: tl.constexpr, HAS_BIAS: tl.constexpr, LORA_DROP: tl.constexpr, ODD_OFFSET: tl.constexpr,
    RANK_TMA: tl.constexpr, F_T: tl.constexpr, R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One program's persistent loop over the LoRA GEMM's tiles ``first_tile, first_tile + tile_step, ...``;
    ``RANK_TMA`` flattens the tile and K loops into one pipeline (docs/kernels.md)."""
    x_desc, w_desc, out_desc = gemm_descriptors(x_ptr, w_ptr, out_ptr, M, N_OUT, K_RED, stride_xm, stride_w,
                                                stride_om, W_NK, BLOCK_M, BLOCK_N, BLOCK_K)
    if RANK_TMA:
        s_desc, f_desc = rank_descriptors(s_ptr, f_ptr, M, N_OUT, R, stride_sm, stride_fr, stride_fn, F_T, BLOCK_M,
                                          BLOCK_N, BLOCK_R)

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    k_tiles = tl.cdiv(K_RED, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n

    # The epilogue's own tile counter: in the flattened pipeline the loop's coordinates may be the next tile's.
    tile_out = first_tile - tile_step
    for tile_id in tl.range(first_tile, num_tiles, tile_step, flatten=RANK_TMA):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA_DROP:
            # The "pre" mask belongs to the LoRA term alone: masked first, then the K loop adds the base term.
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                             stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, "")
            acc = drop_tile(acc * keep_scale, k_row, k_col, p, offs_m, n_offset + pid_n * BLOCK_N, ODD_OFFSET)
        acc = k_loop(acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_out += tile_step
        pid_m, pid_n = tile_coords(tile_out, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if RANK_TMA:
            acc = tile_dot(acc, s_desc, f_desc, pid_m, pid_n, 0, F_T, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N)
        elif not LORA_DROP:
            acc = rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                             stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, "")
        store_tile(acc, out_desc, out_ptr, bias_ptr, pid_m, pid_n, offs_n, N_OUT, stride_bias, HAS_BIAS, BLOCK_M,
                   BLOCK_N)


@triton.jit
def shrink_rows(
    x_ptr, u_ptr, row0, M, K, R, stride_xm, stride_xk, stride_uk, stride_ur, out_scale, p, k_row, k_col,
    k_offset, DROP_PRE: tl.constexpr, ODD_OFFSET: tl.constexpr, DROP_POST: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, X_TMA: tl.constexpr,
):
    """``out_scale * drop_post(drop_pre(x[row0 : row0 + BLOCK_M]) @ U)``, an fp32 ``[BLOCK_M, R_PAD]`` tile; K in
    ``STAGES`` stages (None: the launch's), x through a TMA descriptor with ``X_TMA``."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    m_in = offs_m < M
    r_in = offs_r < R
    # int64 rows: M * stride_xm can pass 2**31.
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    u_ptrs = u_ptr + offs_k[:, None] * stride_uk + offs_r[None, :] * stride_ur

    if X_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])

    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_in = offs_k < K - k0
        if X_TMA:
            x = x_desc.load([row0, k0])
        else:
            x = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
        u = as_operand(tl.load(u_ptrs, mask=k_in[:, None] & r_in[None, :], other=0.0), x_ptr.dtype.element_ty, UPCAST)
        if DROP_PRE:
            x = drop_tile(x, k_row, k_col, p, offs_m, k_offset + k0, ODD_OFFSET)
        if UPCAST:
            x = x.to(tl.float32)
            u = u.to(tl.float32)
        acc = tl.dot(x, u, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        u_ptrs += BLOCK_K * stride_uk

    if DROP_POST:
        acc = drop_tile(acc, k_row, k_col, p, offs_m, 0, False)
    return acc * out_scale


@triton.jit
def reduce_tile(
    feat_ptr, g_ptr, M, F, R, m_start, m_end, tile_f, stride_fm, stride_ff, stride_gm, stride_gr,
    p, k_row, k_col, f_offset,
    DROP_FEAT: tl.constexpr, ODD_OFFSET: tl.constexpr, FEAT_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``g[m_start:m_end]^T @ drop(feat[m_start:m_end, tile])``, an fp32 ``[R_PAD, BLOCK_F]`` tile."""
    offs_f = tile_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    offs_mb = tl.arange(0, BLOCK_M)
    f_in = offs_f < F
    r_in = offs_r < R
    if FEAT_TMA:
        # Zeros past M; a split ends on a BLOCK_M boundary, so no tile crosses into the next split.
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
            ft = drop_tile(ft, k_row, k_col, p, offs_m, f_offset + tile_f * BLOCK_F, ODD_OFFSET)
        if UPCAST:
            ft = ft.to(tl.float32)
            gt = gt.to(tl.float32)
        acc = tl.dot(gt, ft, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def finish_tile(
    acc, out_ptr, ws_ptr, count_ptr, tile, ws_col0, F, R, tile_f, pid_s, num_splits, stride_of, stride_or,
    stride_ws, out_scale, R_PAD: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Store ``out_scale *`` the tile's sum over splits, through the fp32 partials ``ws [split, F, R_PAD]``."""
    offs_f = tile_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_r = tl.arange(0, R_PAD)
    mask = (offs_r[:, None] < R) & (offs_f[None, :] < F)
    out_ptrs = out_ptr + offs_r[:, None] * stride_or + offs_f[None, :] * stride_of
    if num_splits == 1:
        tl.store(out_ptrs, (acc * out_scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (ws_col0 + offs_f[None, :]) * R_PAD + offs_r[:, None]
        tl.store(ws_ptr + pid_s * stride_ws + part, acc, mask=mask)
        # The barrier orders every thread's partial before the release; the last arrival reads them at L2.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = tl.zeros((R_PAD, BLOCK_F), dtype=tl.float32)
            for s in range(0, num_splits):
                total += tl.load(ws_ptr + s * stride_ws + part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total * out_scale).to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def reduce_item(
    tile, pid_s, fa_ptr, ga_ptr, outa_ptr, fb_ptr, gb_ptr, outb_ptr, ws_ptr, count_ptr,
    M, F_A, F_B, R, m_per_split, num_splits,
    stride_fam, stride_faf, stride_gam, stride_gar, stride_oaf, stride_oar,
    stride_fbm, stride_fbf, stride_gbm, stride_gbr, stride_obf, stride_obr, stride_ws,
    scale_a, p, k_row, k_col, f_offset,
    DROP_A: tl.constexpr, ODD_OFFSET: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Reduce and finish one item: column tile ``tile`` (x's tiles, then dy's) over M split ``pid_s``."""
    m_start = pid_s * m_per_split
    m_end = tl.minimum(m_start + m_per_split, M)
    tiles_a = tl.cdiv(F_A, BLOCK_F)
    if tile < tiles_a:
        acc = reduce_tile(
            fa_ptr, ga_ptr, M, F_A, R, m_start, m_end, tile, stride_fam, stride_faf, stride_gam, stride_gar,
            p, k_row, k_col, f_offset, DROP_A, ODD_OFFSET, A_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M,
            STAGES,
        )
        finish_tile(
            acc, outa_ptr, ws_ptr, count_ptr, tile, 0, F_A, R, tile, pid_s, num_splits, stride_oaf, stride_oar,
            stride_ws, scale_a, R_PAD, BLOCK_F,
        )
    else:
        tile_b = tile - tiles_a
        acc = reduce_tile(
            fb_ptr, gb_ptr, M, F_B, R, m_start, m_end, tile_b, stride_fbm, stride_fbf, stride_gbm, stride_gbr,
            p, k_row, k_col, 0, False, False, B_TMA, R_PAD, UPCAST, DOT_PRECISION, BLOCK_F, BLOCK_M, STAGES,
        )
        finish_tile(
            acc, outb_ptr, ws_ptr, count_ptr, tile, F_A, F_B, R, tile_b, pid_s, num_splits, stride_obf,
            stride_obr, stride_ws, 1.0, R_PAD, BLOCK_F,
        )
