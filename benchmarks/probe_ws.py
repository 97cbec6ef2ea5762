"""Probe: does Triton's Hopper warp specialization bring the persistent TMA GEMM to cuBLAS (CUDA).

    python benchmarks/probe_ws.py --out probe_ws.json

Experiments, not library code. ``kernel_breakdown.py`` puts the library's GEMM core (one partition of 8
warps, software-pipelined TMA loads) at 1.03-1.07x cuBLAS on the DESIGN shapes; that gap alone keeps the
forward ratio targets out of reach. Triton >= 3.5 warp-specializes a Hopper loop marked
``tl.range(..., warp_specialize=True)`` (a producer warpgroup issuing the TMA loads, consumer warpgroups the
wgmma), but only where every load in the loop nest goes through a descriptor (a pointer load fails to
compile: "unsupported load type for producer commit"), so the rank-r tiles are read through descriptors
here (needs r % 8 == 0). Variants, timed in interleaved rounds against cuBLAS of the same orientation:

    ws{0,1}_rank{0,1}_s{stages}   no / Hopper warp specialization (num_warps 8 / 4: the partitions add warps);
                        no rank term / the rank-r dot in the epilogue with S and B (or G and A) via TMA.
                        Without it the output is stored as two half tiles (as the library does); with it as
                        one whole tile: Triton 3.6's partitioner rejects the half tiles' reshape ("unsupported
                        op type", first run of this probe), as the tutorial's pruning of that case says.

Both orientations: forward (``y``: W read as [BN, BK] tiles, f = B [N, r]) and dx (W as [BK, BN], f = A).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from probe_gemm import (  # benchmarks/ is this script's folder
    _alloc,
    _coords,
    _tiles,
    launch_checked,
    orientations,
    rows_in_rounds,
)
from report import parse_shapes, probe_parser, run_meta, write_json  # benchmarks/ is this script's folder


@triton.jit
def _probe_ws(
    x_ptr, w_ptr, s_ptr, f_ptr, out_ptr, M, N, K, R,
    RANK: tl.constexpr, WS: tl.constexpr, W_NK: tl.constexpr, NUM_SMS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
        f_desc = tl.make_tensor_descriptor(f_ptr, [N, R], [R, 1], [BN, BR])  # B [N, r]
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BK, BN])
        f_desc = tl.make_tensor_descriptor(f_ptr, [R, N], [N, 1], [BR, BN])  # A [r, N]
    s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [R, 1], [BM, BR])
    if WS:
        o_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN])
    else:
        o_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN // 2])
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=False, warp_specialize=WS):
        pid_m, pid_n = _coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a, b = _tiles(x_desc, w_desc, pid_m, pid_n, ki * BK, W_NK, BM, BN)
            acc = tl.dot(a, b, acc)
        if RANK:
            s = s_desc.load([pid_m * BM, 0])
            if W_NK:
                f = f_desc.load([pid_n * BN, 0]).T
            else:
                f = f_desc.load([0, pid_n * BN])
            acc = tl.dot(s, f, acc)
        if WS:
            o_desc.store([pid_m * BM, pid_n * BN], acc.to(out_ptr.dtype.element_ty))
        else:
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            o_desc.store([pid_m * BM, pid_n * BN], c0.to(out_ptr.dtype.element_ty))
            o_desc.store([pid_m * BM, pid_n * BN + BN // 2], c1.to(out_ptr.dtype.element_ty))


TILES = dict(BM=128, BN=256, BK=64, GROUP_M=8)


def probe(shapes, rounds: int, reps: int):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for M, K, N, r in shapes:
        cases, orients = orientations(M, K, N, r)
        for orient, w_nk, act, W, s, f, (mm, nn_, kk), want, lora in orients:
            # Warp-specialized with the rank tiles and a whole-tile store needs 261 KB in 3 stages (sm_90
            # compile, Triton 3.9): it is tried in 2 as well.
            for ws, stages in ((False, 3), (True, 3), (True, 2)):
                for rank in (False, True):
                    name = f"{orient}_ws{int(ws)}_rank{int(rank)}_s{stages}"
                    out = torch.full((mm, nn_), float("nan"), device="cuda", dtype=torch.bfloat16)
                    grid = (min(nsm, triton.cdiv(mm, TILES["BM"]) * triton.cdiv(nn_, TILES["BN"])),)
                    warps = 4 if ws else 8  # warp specialization adds a producer and a second consumer group
                    kw = dict(RANK=rank, WS=ws, W_NK=w_nk, NUM_SMS=nsm, BR=max(16, r), num_warps=warps,
                              num_stages=stages, **TILES)  # fmt: skip
                    args = (act, W, s, f, out, mm, nn_, kk, r)
                    compiled = launch_checked(_probe_ws, grid, args, kw, out, want + lora if rank else want, name)
                    if compiled is None:
                        continue
                    print(f"{name}: warps {compiled.metadata.num_warps} regs {compiled.n_regs} spills "
                          f"{compiled.n_spills} smem {compiled.metadata.shared}", flush=True)  # fmt: skip
                    cases[name] = lambda g=grid, a=args, k=kw: _probe_ws[g](*a, **k)
        rows += rows_in_rounds((M, K, N, r), cases, rounds, reps)
    return rows


def main():
    parser = probe_parser(__doc__, "probe_ws.json")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    rows = probe(parse_shapes(args.shapes), args.rounds, args.reps)
    write_json(args.out, {"meta": run_meta(tiles=TILES), "rows": rows})


if __name__ == "__main__":
    main()
