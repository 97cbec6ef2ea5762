"""Probe: does a 2-CTA cluster sharing operand tiles by TMA multicast close the GEMM core's gap to cuBLAS (CUDA,
Triton >= 3.9).

    python benchmarks/probe_multicast.py --profile 20 --out probe_multicast.json

On the device (Triton 3.6), carry Triton 3.9 there: ``bash benchmarks/triton_carry.sh build 3.9.0`` here, then
run with carry ``[".triton_carry"]``: ``source benchmarks/triton_carry.sh use; cd benchmarks; python
probe_multicast.py ...``.

Experiments, not library code. The library's persistent TMA GEMM runs at 1.045-1.05x cuBLAS at 8192 x 4096 ->
4096 on the H100 (NOTES.md, sessions 22-23). cuBLAS there is a 256 x 128 tile on a 1 x 2 cluster
(``nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA``): two CTAs on two SMs, one operand tile loaded once and
multicast into both CTAs' shared memory, so the pair reads a third less from L2 than two independent CTAs. The
4th pipeline stage gained nothing (session 23), which pointed at operand traffic, not latency. Triton's
``tl`` cannot launch clusters; Gluon in Triton 3.9 can (``num_ctas=2``, ``tma.async_load(..., multicast=True)``).

One kernel, three launches: a persistent Gluon GEMM, the tile and K loops nested, loads ``STAGES - 1`` steps
ahead across tile boundaries (``probe_gluon.py``'s ``pipe``, which was 1.019x cuBLAS on the H200 in session 16).
With ``num_ctas=2`` a program is a cluster of two CTAs, each computing and storing its own ``BM x BN``: with x
shared the cluster tile is ``BM x 2BN`` and the activation tile ``[BM, BK]`` is multicast (CTA 0 issues it into
both CTAs) while each CTA loads its own half of the weight tile; with W shared the cluster tile is ``2BM x BN``
and the roles swap. Before CTA 0 multicasts into a stage again, both CTAs must have retired their wgmma on it: a
pair barrier per stage (each CTA arrives after its ``warpgroup_mma_wait``, only CTA 0 waits). With
``num_ctas=1`` the same code is the plain pipelined core, with no pair barriers.

Result (session 25, H100): neither cluster beats the one-CTA core; sharing x costs 4-5% (NOTES.md).

Variants in the same interleaved rounds, both orientations (``y = x W^T``: W tiles ``[BN, BK]`` read
transposed; ``dx = dy W``: W tiles ``[BK, BN]``), no rank term:

    {y,dx}_triton      the library's Triton core structure (``probe_ws._probe_ws``, WS off, 128x256x64 s3 w8)
    {y,dx}_g1          Gluon, one CTA a program, 128 x 256 tiles
    {y,dx}_g2          Gluon, a 2-CTA cluster a program, 128 x 512 cluster tiles (128 x 256 a CTA), x multicast
    {y,dx}_g2w         the same with the cluster along M: 256 x 256 cluster tiles, w's [256, 64] tile multicast
                       (the larger operand: the pair reads a third less, not a sixth as with x shared)
    {y,dx}_g2*_pN      the same on N clusters instead of the occupancy query's count (``--progs``)
"""

from __future__ import annotations

import torch
import triton
from probe_gemm import _alloc, launch_checked, orientations, rows_in_rounds  # benchmarks/ is this folder
from probe_ws import TILES, _probe_ws  # benchmarks/ is this script's folder
from report import parse_shapes, probe_parser, run_meta, write_json  # benchmarks/ is this script's folder
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    cluster,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from parallel_lora.kernels.gemm_tma import tile_coords  # the library's grouped order (Gluon calls @triton.jit)


@gluon.jit
def _issue(x_desc, w_desc, x_bufs, w_bufs, ready, stage, pid_m, pid_n, kk, pred, W_NK: gl.constexpr,
           SHARE_W: gl.constexpr):  # fmt: skip
    """K step ``kk`` of cluster tile (pid_m, pid_n) into ``stage``: the shared operand's tile multicast to the
    cluster (issued by CTA 0), each CTA's share of the other, both landing on the CTA's own ``ready`` barrier."""
    BM: gl.constexpr = x_desc.block_shape[0]
    BK: gl.constexpr = x_desc.block_shape[1]
    MC: gl.constexpr = gl.num_ctas() > 1
    bar = ready.index(stage)
    mbarrier.expect(bar, x_desc.nbytes_per_cta + w_desc.nbytes_per_cta, pred=pred)
    tma.async_load(x_desc, [pid_m * BM, kk * BK], bar, x_bufs.index(stage), pred=pred, multicast=MC and not SHARE_W)
    if W_NK:
        BNC: gl.constexpr = w_desc.block_shape[0]
        tma.async_load(w_desc, [pid_n * BNC, kk * BK], bar, w_bufs.index(stage), pred=pred, multicast=MC and SHARE_W)
    else:
        BNC: gl.constexpr = w_desc.block_shape[1]
        tma.async_load(w_desc, [kk * BK, pid_n * BNC], bar, w_bufs.index(stage), pred=pred, multicast=MC and SHARE_W)


@gluon.jit
def _mc_gemm(x_desc, w_desc, c_desc, M, N, K, W_NK: gl.constexpr, SHARE_W: gl.constexpr, GROUP_M: gl.constexpr,
             NUM_PROGS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    MC: gl.constexpr = gl.num_ctas() > 1
    BM: gl.constexpr = c_desc.block_shape[0]  # the cluster tile's rows
    BNC: gl.constexpr = c_desc.block_shape[1]  # the cluster tile's columns
    BK: gl.constexpr = x_desc.block_shape[1]
    BN_CTA: gl.constexpr = BNC if SHARE_W else BNC // gl.num_ctas()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN_CTA, 16],
        cga_layout=c_desc.layout.cga_layout,
    )  # fmt: skip
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if MC:  # one barrier a stage for the pair, on CTA 0: both CTAs arrive, CTA 0 waits
        empty = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=1)

    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BNC)
    k_tiles = gl.cdiv(K, BK)
    tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), NUM_PROGS)
    total = tiles * k_tiles
    pid_m, pid_n = tile_coords(gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    for i in gl.static_range(STAGES - 1):  # (assumes k_tiles >= STAGES - 1)
        _issue(x_desc, w_desc, x_bufs, w_bufs, ready, i, pid_m, pid_n, i, i < total, W_NK, SHARE_W)

    step = 0
    stage = 0
    phase = 0
    for t in range(tiles):
        next_m, next_n = tile_coords(gl.program_id(0) + (t + 1) * NUM_PROGS, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((BM, BNC), gl.float32, acc_layout)
        for kk in range(k_tiles):
            mbarrier.wait(ready.index(stage), phase)
            if W_NK:
                acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage), acc, is_async=True)
            # The previous step's wgmma has retired: its stage takes the load STAGES - 1 steps ahead.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            load_stage = gl.where(stage == 0, STAGES - 1, stage - 1)
            ahead = kk + (STAGES - 1)
            nxt = ahead >= k_tiles
            pred = step + (STAGES - 1) < total
            if MC:
                # The previous step read load_stage in both CTAs, and CTA 0's multicast writes into both.
                free_phase = gl.where(stage == 0, phase ^ 1, phase)
                mbarrier.arrive(empty.index(load_stage), pred=step > 0)
                mbarrier.wait(empty.index(load_stage), free_phase, pred=(step > 0) & pred)
            nxt_k = gl.where(nxt, ahead - k_tiles, ahead)
            _issue(x_desc, w_desc, x_bufs, w_bufs, ready, load_stage, gl.where(nxt, next_m, pid_m),
                   gl.where(nxt, next_n, pid_n), nxt_k, pred, W_NK, SHARE_W)  # fmt: skip
            step += 1
            wrap = stage == STAGES - 1
            stage = gl.where(wrap, 0, stage + 1)
            phase = gl.where(wrap, phase ^ 1, phase)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        tma.store_wait(0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_store(c_desc, [pid_m * BM, pid_n * BNC], c_smem)
        pid_m = next_m
        pid_n = next_n
    tma.store_wait(0)
    if MC:  # no CTA leaves while its partner may still arrive on its barriers
        cluster.barrier()


def cluster_tile(BM: int, BN: int, ctas: int, share_w: bool) -> tuple[int, int]:
    """A cluster's output tile: ``ctas`` CTA tiles stacked along M (W shared) or side by side along N (x shared)."""
    return (BM * ctas, BN) if share_w else (BM, BN * ctas)


def descriptors(act, W, out, w_nk: bool, BM: int, BN: int, BK: int, ctas: int, share_w: bool):
    """Host TMA descriptors for a cluster of ``ctas`` CTAs. x shared: the cluster spans the output's columns, x's
    tile goes to every CTA (multicast), w's and the output's are split along the columns. w shared: the cluster
    spans the rows, and x's and the output's tiles are split along the rows."""
    split = ctas > 1
    bm, bn = cluster_tile(BM, BN, ctas, share_w)
    whole, rows, cols = [[0, 0]], [[1, 0]], [[0, 1]]

    def desc(t, block, cga):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16, cga_layout=cga if split else None)
        return TensorDescriptor.from_tensor(t, block, layout)

    if share_w:
        w_desc = desc(W, [bn, BK], whole) if w_nk else desc(W, [BK, bn], whole)
        return desc(act, [bm, BK], rows), w_desc, desc(out, [bm, bn], rows)
    w_desc = desc(W, [bn, BK], rows) if w_nk else desc(W, [BK, bn], cols)
    return desc(act, [bm, BK], whole), w_desc, desc(out, [bm, bn], cols)


def launch_args(act, W, w_nk: bool, dims, ctas: int, share_w: bool):
    """A fresh NaN-filled output and ``_mc_gemm``'s arguments writing into it."""
    mm, nn_, kk = dims
    out = torch.full((mm, nn_), float("nan"), device="cuda", dtype=torch.bfloat16)
    return out, (*descriptors(act, W, out, w_nk, TILES["BM"], TILES["BN"], TILES["BK"], ctas, share_w), mm, nn_, kk)


def max_clusters(compiled, ctas: int) -> int:
    """How many clusters of ``ctas`` CTAs of ``compiled`` the GPU holds at once (cuOccupancyMaxActiveClusters)."""
    utils = triton.runtime.driver.active.utils
    return utils.cuOccupancyMaxActiveClusters(compiled.function, compiled.metadata.shared, ctas)


def probe(shapes, rounds: int, reps: int, stages: int, profile: int, progs: list[int]):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    BM, BN, GROUP_M = TILES["BM"], TILES["BN"], TILES["GROUP_M"]
    rows = []
    for M, K, N, r in shapes:
        cases, orients = orientations(M, K, N, r)
        checks = {}
        for orient, w_nk, act, W, s, f, (mm, nn_, kk), want, _ in orients:
            out = torch.full((mm, nn_), float("nan"), device="cuda", dtype=torch.bfloat16)
            grid = (min(nsm, triton.cdiv(mm, BM) * triton.cdiv(nn_, BN)),)
            kw = dict(RANK=False, WS=False, W_NK=w_nk, NUM_SMS=nsm, BR=max(16, r), num_warps=8, num_stages=3,
                      **TILES)  # fmt: skip
            args = (act, W, s, f, out, mm, nn_, kk, r)
            if launch_checked(_probe_ws, grid, args, kw, out, want, f"{orient}_triton") is not None:
                cases[f"{orient}_triton"] = lambda g=grid, a=args, k=kw: _probe_ws[g](*a, **k)
            for ctas, share_w in ((1, False), (2, False), (2, True)):
                name = f"{orient}_g{ctas}" + ("w" if share_w else "")
                bm, bn = cluster_tile(BM, BN, ctas, share_w)
                tiles = triton.cdiv(mm, bm) * triton.cdiv(nn_, bn)
                n_progs = min(nsm // ctas, tiles)
                kwg = dict(W_NK=w_nk, SHARE_W=share_w, GROUP_M=GROUP_M, NUM_PROGS=n_progs, STAGES=stages,
                           num_warps=8, num_ctas=ctas)  # fmt: skip
                out, gargs = launch_args(act, W, w_nk, (mm, nn_, kk), ctas, share_w)
                compiled = launch_checked(_mc_gemm, (n_progs,), gargs, kwg, out, want, name + "_first")
                if compiled is None:
                    continue
                fits = max_clusters(compiled, ctas) if ctas > 1 else nsm
                print(f"{name}: regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared}"
                      f" clusters that fit {fits}", flush=True)  # fmt: skip
                counts = [min(fits, n_progs)] + ([p for p in progs if p != min(fits, n_progs)] if ctas > 1 else [])
                for i, p in enumerate(counts):
                    kwp = {**kwg, "NUM_PROGS": p}
                    label = name if i == 0 else f"{name}_p{p}"
                    out, gargs = launch_args(act, W, w_nk, (mm, nn_, kk), ctas, share_w)
                    if launch_checked(_mc_gemm, (p,), gargs, kwp, out, want, label) is not None:
                        cases[label] = lambda g=(p,), a=gargs, k=kwp: _mc_gemm[g](*a, **k)
                        checks[label] = (out, want)
        rows += rows_in_rounds((M, K, N, r), cases, rounds, reps, profile)
        # A race between the cluster's CTAs would show in some calls only: check the last timed call's output.
        for label, (out, want) in checks.items():
            err = ((out.float() - want).norm() / want.norm()).item()
            print(f"{label}: rel err after timing {err:.2e}", flush=True)
            for row in rows:
                if row["shape"] == [M, K, N, r] and row["variant"] == label:
                    row["rel_err_after"] = err
    return rows


def main():
    parser = probe_parser(__doc__, "probe_multicast.json")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--progs", default="", help="more cluster counts to time the 2-CTA kernel on, e.g. 64,62")
    parser.add_argument("--profile", type=int, default=0, help="time N calls back to back by profiler, not do_bench")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    progs = [int(p) for p in args.progs.split(",") if p]
    meta = run_meta(tiles=TILES, stages=args.stages, profile=args.profile, progs=progs)
    rows = []
    for shape in parse_shapes(args.shapes):  # written shape by shape: a run cut short keeps what it measured
        rows += probe([shape], args.rounds, args.reps, args.stages, args.profile, progs)
        write_json(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
