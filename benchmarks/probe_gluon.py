"""Probe: does a Gluon GEMM core, pipelined across the tiles of a persistent program, close the gap to cuBLAS (CUDA).

    python benchmarks/probe_gluon.py --out probe_gluon.json

Experiments, not library code. The library's persistent TMA GEMM (``kernels/gemm_tma.py``, Triton) runs at
1.03-1.05x cuBLAS on the DESIGN shapes. Each of its program's tiles starts on an empty pipeline: the K loop's
first loads are issued only after the previous tile's epilogue (convert, stage in shared memory, TMA store),
and Triton gives no way to issue them earlier. With 8 tiles of ~45 us per program at 8192x4096->4096, 1-2 us
of fill and epilogue per tile is the whole gap. Gluon (Triton's lower-level dialect, ``triton.experimental.
gluon``) schedules loads, wgmma and barriers by hand, so the next tile's first stages can load while the
current tile drains and stores. Variants, timed in interleaved rounds against cuBLAS of the same orientation:

    {y,dx}_triton_rank{0,1}    the Triton core as the library builds it (``probe_ws._probe_ws``, WS off)
    {y,dx}_pipe_rank{0,1}      Gluon, one partition: tile and K loops nested, one step counter across them,
                               the loads STAGES - 1 steps ahead of the wgmma, across tile boundaries
    {y,dx}_pipec_rank{0,1}     the same with the stage and phase as wrapping counters, no division in the K loop
                               (what made the fused forward's loop uniform-datapath work: NOTES.md, session 16)
    {y,dx}_ws_rank{0,1}        Gluon, warp-specialized: a 1-warp partition issues every TMA load (and runs
                               ahead into the next tile by itself); the 8 default warps issue wgmma and store
    {y,dx}_tws_rank{0,1}       Triton's own Hopper warp specialization (``probe_ws``: 2 stages with the rank)
    {y,dx}_tflat_rank{0,1}     Triton with the tile and K loops flattened (``probe_gemm``, the rank term's
                               tiles through TMA in the epilogue)
    {y,dx}_ttma_rank{0,1}      the same with the loops nested (the library's loops, only the rank tiles'
                               loads through TMA instead of pointers)

With the rank term, each tile's ``s [BM, r]`` and ``f`` tiles come in through TMA with the tile's first stage
into one extra buffer, and their wgmma goes first (``use_acc=False``), the K loop accumulating onto it: the
order the library uses for "pre" dropout, where the mask must touch the rank term alone.

Both orientations: forward (``y``: W read as [BN, BK] tiles and transposed in shared memory, f = B [N, r]) and
dx (W as [BK, BN], f = A [r, N]). Tiles 128x256x64, 3 stages, 8 warps, grouped order (GROUP_M 8), the output
staged whole (3 x 48 KB + 64 KB + the rank buffer's 12 KB = 220 KB).
"""

from __future__ import annotations

import torch
import triton
from probe_gemm import (  # benchmarks/ is this script's folder
    _alloc,
    _probe_gemm,
    launch_checked,
    orientations,
    rows_in_rounds,
)
from probe_ws import TILES, _probe_ws  # benchmarks/ is this script's folder
from report import parse_shapes, probe_parser, run_meta, write_json  # benchmarks/ is this script's folder
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from parallel_lora.kernels.gemm_tma import tile_coords  # the library's grouped order (Gluon calls @triton.jit)

# Triton 3.9 removed the 3.6 names (the device has 3.6; a run may carry 3.9: benchmarks/triton_carry.sh).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


@gluon.jit
def _step_coords(step, k_tiles, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr):
    """Step ``step`` of this program's flattened (tile, k) loop: its tile's (pid_m, pid_n) and its k index."""
    tile_id = gl.program_id(0) + (step // k_tiles) * NUM_SMS
    pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    return pid_m, pid_n, step % k_tiles


@gluon.jit
def _load_xw(x_desc, w_desc, x_bufs, w_bufs, ready, stage, pid_m, pid_n, kk, pred, W_NK: gl.constexpr):
    """x's and w's tiles of K step ``kk`` of tile (pid_m, pid_n) into ``stage``, landing on its ``ready``
    barrier (skipped unless ``pred``)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    bar = ready.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    _tma_load(x_desc, [pid_m * BM, kk * BK], bar, x_bufs.index(stage), pred=pred)
    if W_NK:
        BN: gl.constexpr = w_desc.block_type.shape[0]
        _tma_load(w_desc, [pid_n * BN, kk * BK], bar, w_bufs.index(stage), pred=pred)
    else:
        BN: gl.constexpr = w_desc.block_type.shape[1]
        _tma_load(w_desc, [kk * BK, pid_n * BN], bar, w_bufs.index(stage), pred=pred)


@gluon.jit
def _load_rank(s_desc, f_desc, s_buf, f_buf, bar, pid_m, pid_n, pred, W_NK: gl.constexpr):
    """Tile (pid_m, pid_n)'s rank tiles (``s [BM, r]``, and f's ``[BN, r]`` or ``[r, BN]``), landing on ``bar``
    (skipped unless ``pred``)."""
    BM: gl.constexpr = s_desc.block_type.shape[0]
    mbarrier.expect(bar, s_desc.block_type.nbytes + f_desc.block_type.nbytes, pred=pred)
    _tma_load(s_desc, [pid_m * BM, 0], bar, s_buf, pred=pred)
    if W_NK:
        BN: gl.constexpr = f_desc.block_type.shape[0]
        _tma_load(f_desc, [pid_n * BN, 0], bar, f_buf, pred=pred)
    else:
        BN: gl.constexpr = f_desc.block_type.shape[1]
        _tma_load(f_desc, [0, pid_n * BN], bar, f_buf, pred=pred)


@gluon.jit
def _issue_loads(pid_m, pid_n, kk, stage, pred, x_desc, w_desc, s_desc, f_desc, x_bufs, w_bufs, s_buf, f_buf, ready,
                 rank_ready, RANK: gl.constexpr, W_NK: gl.constexpr):  # fmt: skip
    """TMA loads of k step ``kk`` of tile (pid_m, pid_n) into ``stage`` (skipped unless ``pred``); at a tile's
    first step also its rank tiles, on ``rank_ready``."""
    _load_xw(x_desc, w_desc, x_bufs, w_bufs, ready, stage, pid_m, pid_n, kk, pred, W_NK)
    if RANK:
        first = pred & (kk == 0)
        _load_rank(s_desc, f_desc, s_buf, f_buf, rank_ready, pid_m, pid_n, first, W_NK)


@gluon.jit
def _b_operand(buf, W_NK: gl.constexpr):
    """A [BK, BN] view of a w (or f) tile: ``W_NK`` tiles sit K-contiguous and are read transposed."""
    if W_NK:
        return buf.permute((1, 0))
    else:
        return buf


@gluon.jit
def _open_tile(s_buf, f_buf, rank_ready, t, BM: gl.constexpr, BN: gl.constexpr, acc_layout: gl.constexpr,
               RANK: gl.constexpr, W_NK: gl.constexpr):  # fmt: skip
    """The program's ``t``-th tile's fp32 accumulator: zeros, or its rank term ``s_tile @ f_tile`` (the first
    wgmma of the tile, once the rank tiles have landed on ``rank_ready``)."""
    acc = gl.zeros((BM, BN), gl.float32, acc_layout)
    if RANK:
        mbarrier.wait(rank_ready, t & 1)
        acc = warpgroup_mma(s_buf, _b_operand(f_buf, W_NK), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # nothing else in flight: no wait, a tensor again
    return acc


@gluon.jit
def _epilogue(acc, c_desc, c_smem, pid_m, pid_n):
    """Round the tile once and store it through ``c_smem`` (after the previous tile's store has read it)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    tma.store_wait(0)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)


@gluon.jit
def _tile_buffers(x_desc, w_desc, s_desc, f_desc, c_desc, STAGES: gl.constexpr):
    """Shared memory of both Gluon variants: ``STAGES`` x and w tiles, one s and one f (rank) tile, and the output
    tile's staging buffer, each in its descriptor's layout."""
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    s_buf = gl.allocate_shared_memory(dtype, s_desc.block_type.shape, s_desc.layout)
    f_buf = gl.allocate_shared_memory(dtype, f_desc.block_type.shape, f_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    return x_bufs, w_bufs, s_buf, f_buf, c_smem


@gluon.jit
def _program_work(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_SMS: gl.constexpr):
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), NUM_SMS)
    return num_pid_m, num_pid_n, k_tiles, my_tiles * k_tiles


@gluon.jit
def _gluon_pipe(
    x_desc, w_desc, s_desc, f_desc, c_desc, M, N, K, RANK: gl.constexpr, W_NK: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, COUNTERS: gl.constexpr = False,
):  # fmt: skip
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    x_bufs, w_bufs, s_buf, f_buf, c_smem = _tile_buffers(x_desc, w_desc, s_desc, f_desc, c_desc, STAGES)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    rank_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(rank_ready, count=1)

    num_pid_m, num_pid_n, k_tiles, total = _program_work(M, N, K, BM, BN, BK, NUM_SMS)
    tiles = total // k_tiles
    pid_m, pid_n = tile_coords(gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    for i in gl.static_range(STAGES - 1):  # (assumes k_tiles >= STAGES - 1)
        _issue_loads(pid_m, pid_n, i, i, i < total, x_desc, w_desc, s_desc, f_desc, x_bufs, w_bufs, s_buf, f_buf,
                     ready, rank_ready, RANK, W_NK)  # fmt: skip

    # Tile and K loops stay nested: a branch inside the loop that carries the in-flight accumulator makes ptxas
    # wait for every wgmma at the join (a flattened loop with the epilogue under `if` ran at 1.44x cuBLAS). The
    # loads' coordinates are selects between this tile and the next, computed once a tile: integer divisions
    # in the K loop land between its wgmma (NOTES.md, session 13). The stage index still divides by STAGES
    # here unless COUNTERS (the "pipec" variant), as it did when the session-16 results were taken.
    step = 0
    stage = 0  # with COUNTERS: the step's stage and barrier phase, wrapped by hand instead of divided out
    phase = 0
    for t in range(tiles):
        next_m, next_n = tile_coords(gl.program_id(0) + (t + 1) * NUM_SMS, num_pid_m, num_pid_n, GROUP_M)
        # (The rank buffer is refilled only STAGES - 1 steps before the next tile, long after the tile's rank
        # wgmma has completed, as long as k_tiles >= STAGES.)
        acc = _open_tile(s_buf, f_buf, rank_ready, t, BM, BN, acc_layout, RANK, W_NK)
        for kk in range(k_tiles):
            if not COUNTERS:
                stage = step % STAGES
                phase = (step // STAGES) & 1
            mbarrier.wait(ready.index(stage), phase)
            acc = warpgroup_mma(x_bufs.index(stage), _b_operand(w_bufs.index(stage), W_NK), acc, is_async=True)
            # One wgmma left in flight: the previous step's stage is free for the load STAGES - 1 steps
            # ahead, which may belong to the next tile (its pipeline fills while this tile drains and stores).
            acc = warpgroup_mma_wait(1, deps=(acc,))
            ahead = kk + (STAGES - 1)
            nxt = ahead >= k_tiles
            if COUNTERS:
                load_stage = gl.where(stage == 0, STAGES - 1, stage - 1)
            else:
                load_stage = (step + STAGES - 1) % STAGES
            _issue_loads(gl.where(nxt, next_m, pid_m), gl.where(nxt, next_n, pid_n),
                         gl.where(nxt, ahead - k_tiles, ahead), load_stage, step + (STAGES - 1) < total, x_desc,
                         w_desc, s_desc, f_desc, x_bufs, w_bufs, s_buf, f_buf, ready, rank_ready, RANK,
                         W_NK)  # fmt: skip
            step += 1
            if COUNTERS:
                wrap = stage == STAGES - 1
                stage = gl.where(wrap, 0, stage + 1)
                phase = gl.where(wrap, phase ^ 1, phase)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _epilogue(acc, c_desc, c_smem, pid_m, pid_n)
        pid_m = next_m
        pid_n = next_n
    tma.store_wait(0)


@gluon.jit
def _ws_loader(x_desc, w_desc, s_desc, f_desc, x_bufs, w_bufs, s_buf, f_buf, ready, empty, rank_ready, rank_empty,
               M, N, K, RANK: gl.constexpr, W_NK: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr,
               STAGES: gl.constexpr):  # fmt: skip
    """The load partition (1 warp): every TMA load, each stage once the wgmma partition has released it."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    if W_NK:
        BN: gl.constexpr = w_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = w_desc.block_type.shape[1]
    num_pid_m, num_pid_n, k_tiles, total = _program_work(M, N, K, BM, BN, BK, NUM_SMS)
    for step in range(total):
        stage = step % STAGES
        pid_m, pid_n, kk = _step_coords(step, k_tiles, num_pid_m, num_pid_n, GROUP_M, NUM_SMS)
        if RANK:
            if kk == 0:
                mbarrier.wait(rank_empty, ((step // k_tiles) & 1) ^ 1)
                _load_rank(s_desc, f_desc, s_buf, f_buf, rank_ready, pid_m, pid_n, True, W_NK)
        mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
        _load_xw(x_desc, w_desc, x_bufs, w_bufs, ready, stage, pid_m, pid_n, kk, True, W_NK)


@gluon.jit
def _ws_mma(x_bufs, w_bufs, s_buf, f_buf, c_smem, ready, empty, rank_ready, rank_empty, c_desc, M, N, K,
            RANK: gl.constexpr, W_NK: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr,
            STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The default partition (8 warps): wgmma on each stage as it lands, then the tile's epilogue."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    num_pid_m, num_pid_n, k_tiles, total = _program_work(M, N, K, BM, BN, BK, NUM_SMS)
    step = 0
    for t in range(total // k_tiles):
        pid_m, pid_n, _ = _step_coords(step, k_tiles, num_pid_m, num_pid_n, GROUP_M, NUM_SMS)
        acc = _open_tile(s_buf, f_buf, rank_ready, t, BM, BN, acc_layout, RANK, W_NK)
        for kk in range(k_tiles):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(stage), _b_operand(w_bufs.index(stage), W_NK), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # The previous step's wgmma (and this tile's rank wgmma) has completed: release their buffers.
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=step > 0)
            if RANK:
                mbarrier.arrive(rank_empty, pred=kk == 0)
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _epilogue(acc, c_desc, c_smem, pid_m, pid_n)
    tma.store_wait(0)


@gluon.jit
def _gluon_ws(
    x_desc, w_desc, s_desc, f_desc, c_desc, M, N, K, RANK: gl.constexpr, W_NK: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    x_bufs, w_bufs, s_buf, f_buf, c_smem = _tile_buffers(x_desc, w_desc, s_desc, f_desc, c_desc, STAGES)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    rank_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    rank_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(rank_ready, count=1)
    mbarrier.init(rank_empty, count=1)
    gl.warp_specialize(
        [
            (_ws_mma, (x_bufs, w_bufs, s_buf, f_buf, c_smem, ready, empty, rank_ready, rank_empty, c_desc, M, N, K,
                       RANK, W_NK, GROUP_M, NUM_SMS, STAGES, num_warps)),
            (_ws_loader, (x_desc, w_desc, s_desc, f_desc, x_bufs, w_bufs, s_buf, f_buf, ready, empty, rank_ready,
                          rank_empty, M, N, K, RANK, W_NK, GROUP_M, NUM_SMS, STAGES)),
        ],
        [1],
        [40],
    )  # fmt: skip


def descriptors(act, W, s, f, out, w_nk: bool, BM: int, BN: int, BK: int):
    """Host TMA descriptors of one orientation's operands (the rank tiles ``[BM, r]`` and ``[BN, r]`` / ``[r, BN]``)."""
    R = s.shape[1]

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    if w_nk:
        w_block, f_block = [BN, BK], [BN, R]
    else:
        w_block, f_block = [BK, BN], [R, BN]
    return desc(act, [BM, BK]), desc(W, w_block), desc(s, [BM, R]), desc(f, f_block), desc(out, [BM, BN])


def probe(shapes, rounds: int, reps: int, stages: int, kinds: list[str], profile: int):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    BM, BN, BK, GROUP_M = TILES["BM"], TILES["BN"], TILES["BK"], TILES["GROUP_M"]
    rows = []
    for M, K, N, r in shapes:
        cases, orients = orientations(M, K, N, r)
        for orient, w_nk, act, W, s, f, (mm, nn_, kk), want, lora in orients:
            grid = (min(nsm, triton.cdiv(mm, BM) * triton.cdiv(nn_, BN)),)
            for rank in (False, True):
                ref = want + lora if rank else want
                # The library's structure, in the same rounds.
                name = f"{orient}_triton_rank{int(rank)}"
                out = torch.full((mm, nn_), float("nan"), device="cuda", dtype=torch.bfloat16)
                kw = dict(RANK=rank, WS=False, W_NK=w_nk, NUM_SMS=nsm, BR=max(16, r), num_warps=8, num_stages=3,
                          **TILES)  # fmt: skip
                args = (act, W, s, f, out, mm, nn_, kk, r)
                if launch_checked(_probe_ws, grid, args, kw, out, ref, name) is not None:
                    cases[name] = lambda g=grid, a=args, k=kw: _probe_ws[g](*a, **k)
                if "tws" in kinds:  # Triton's own Hopper warp specialization (probe_ws: 2 stages with the rank)
                    name = f"{orient}_tws_rank{int(rank)}"
                    kw = {**kw, "WS": True, "num_warps": 4, "num_stages": 2 if rank else 3}
                    if launch_checked(_probe_ws, grid, args, kw, out, ref, name) is not None:
                        cases[name] = lambda g=grid, a=args, k=kw: _probe_ws[g](*a, **k)
                # Triton's loops in probe_gemm, the rank tiles through TMA: flattened (``tflat``) or nested
                # (``ttma``, the library's loops with only the rank tiles' loads changed).
                for kind, flatten in (("tflat", True), ("ttma", False)):
                    if kind not in kinds:
                        continue
                    name = f"{orient}_{kind}_rank{int(rank)}"
                    kw = dict(LORA=3 if rank else 0, FLATTEN=flatten, SUBTILE=True, W_NK=w_nk, NUM_SMS=nsm,
                              BR=max(16, r), num_warps=8, num_stages=3, **TILES)  # fmt: skip
                    if launch_checked(_probe_gemm, grid, args, kw, out, ref, name) is not None:
                        cases[name] = lambda g=grid, a=args, k=kw: _probe_gemm[g](*a, **k)
                for kind, kernel in (("pipe", _gluon_pipe), ("pipec", _gluon_pipe), ("ws", _gluon_ws)):
                    if kind not in kinds:
                        continue
                    name = f"{orient}_{kind}_rank{int(rank)}"
                    out = torch.full((mm, nn_), float("nan"), device="cuda", dtype=torch.bfloat16)
                    args = (*descriptors(act, W, s, f, out, w_nk, BM, BN, BK), mm, nn_, kk)
                    kw = dict(RANK=rank, W_NK=w_nk, GROUP_M=GROUP_M, NUM_SMS=nsm, STAGES=stages, num_warps=8)
                    if kind == "pipec":
                        kw["COUNTERS"] = True
                    if kind == "ws":
                        # 8 + 4 warps (the loader's warpgroup) share the register file: 168 a thread at launch,
                        # then the loader gives back to 40 and the wgmma warps grow to 232.
                        kw["maxnreg"] = 168
                    compiled = launch_checked(kernel, grid, args, kw, out, ref, name)
                    if compiled is None:
                        continue
                    print(f"{name}: regs {compiled.n_regs} spills {compiled.n_spills} smem "
                          f"{compiled.metadata.shared}", flush=True)  # fmt: skip
                    cases[name] = lambda g=grid, a=args, k=kw, kern=kernel: kern[g](*a, **k)
        rows += rows_in_rounds((M, K, N, r), cases, rounds, reps, profile)
    return rows


def main():
    parser = probe_parser(__doc__, "probe_gluon.json")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--kinds", default="pipe,ws", help="pipe, pipec, ws (Gluon); tws, tflat, ttma (Triton:"
                        " warp-specialized, flattened loops, nested loops with TMA rank tiles)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, help="time N calls back to back by profiler, not do_bench")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    rows = probe(parse_shapes(args.shapes), args.rounds, args.reps, args.stages, args.kinds.split(","), args.profile)
    meta = run_meta(tiles=TILES, stages=args.stages, kinds=args.kinds, profile=args.profile)
    write_json(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
