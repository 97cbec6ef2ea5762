"""Probe: where the rank-r term of the persistent TMA GEMM should go, timed A/B in one process (CUDA).

    python benchmarks/probe_rank_term.py --out probe_rank.json
    python benchmarks/probe_rank_term.py --ttgir DIR      # also write each variant's TTGIR (what was pipelined)
    python benchmarks/probe_rank_term.py --profile 20     # kernel time back to back (no L2 flush), not do_bench

Experiments, not library code. ``kernel_breakdown.py`` (NOTES.md, session 6) put the epilogue rank term of
``gemm_tma._lora_gemm_tma_kernel`` at ~38 us over its r = 0 run at 8192 x 4096 -> 4096 (r = 0 runs the same
instructions on masked-off loads, so the cost is the S / B loads), and one experiment's numbers came from two
machines whose cuBLAS differed by 13%. This probe times every variant and cuBLAS in interleaved rounds in one
process and reports each variant's median ratio to cuBLAS of the same round. ``RANK`` switches:

    0  no rank term (the bare core)
    1  epilogue, masked pointer loads after the K loop (what the library does)
    2  the same loads issued before the K loop, the dot after it, their registers touched after the loop
       (else the compiler moves their conversion to shared memory, which waits for them, up to the loads)
    3  epilogue, S and B (or A) through TMA descriptors
    4  one more step of the pipelined K loop: S and B (or A) tiles through TMA descriptors at the last step,
       zero-filled past r (needs r % 8 == 0); Triton compiles the branch unpipelined (one stage, 80 KB of
       shared memory, 4x cuBLAS), so it is compiled and checked but not timed
    5  prologue: the masked pointer loads and the rank-r dot before the K loop, which then accumulates onto it
       (what the library does for dx under "pre" dropout)

Both orientations: forward (``W_NK``: W read as [BN, BK] tiles, f = B [N, r]) and dx (W as [BK, BN], f = A).
"""

from __future__ import annotations

import os

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
def _ptr_tiles(s_ptr, f_ptr, offs_m, offs_n, M, N, R, W_NK: tl.constexpr, BR: tl.constexpr):
    offs_r = tl.arange(0, BR)
    rows64 = offs_m[:, None].to(tl.int64)
    s = tl.load(s_ptr + rows64 * R + offs_r[None, :], mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)
    if W_NK:  # f[r, n] = B[n, r]
        f = tl.load(f_ptr + offs_n[None, :] * R + offs_r[:, None], mask=(offs_r[:, None] < R) & (offs_n[None, :] < N),
                    other=0.0)  # fmt: skip
    else:  # f = A [r, N]
        f = tl.load(f_ptr + offs_r[:, None] * N + offs_n[None, :], mask=(offs_r[:, None] < R) & (offs_n[None, :] < N),
                    other=0.0)  # fmt: skip
    return s, f


@triton.jit
def _probe_rank(
    x_ptr, w_ptr, s_ptr, f_ptr, out_ptr, M, N, K, R,
    RANK: tl.constexpr, W_NK: tl.constexpr, NUM_SMS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BK, BN])
    o_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN // 2])
    if RANK == 3:
        s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [R, 1], [BM, BR])
        if W_NK:
            f_desc = tl.make_tensor_descriptor(f_ptr, [N, R], [R, 1], [BN, BR])
        else:
            f_desc = tl.make_tensor_descriptor(f_ptr, [R, N], [N, 1], [BR, BN])
    if RANK == 4:
        s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [R, 1], [BM, BK])
        if W_NK:
            f_desc = tl.make_tensor_descriptor(f_ptr, [N, R], [R, 1], [BN, BK])
        else:
            f_desc = tl.make_tensor_descriptor(f_ptr, [R, N], [N, 1], [BK, BN])

    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = _coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if RANK == 2 or RANK == 5:
            s, f = _ptr_tiles(s_ptr, f_ptr, offs_m, offs_n, M, N, R, W_NK, BR)
        if RANK == 5:
            acc = tl.dot(s, f, acc)
        if RANK == 4:
            for ki in range(k_tiles + 1):
                if ki < k_tiles:
                    a, b = _tiles(x_desc, w_desc, pid_m, pid_n, ki * BK, W_NK, BM, BN)
                else:
                    a, b = _tiles(s_desc, f_desc, pid_m, pid_n, 0, W_NK, BM, BN)
                acc = tl.dot(a, b, acc)
        else:
            for ki in range(k_tiles):
                a, b = _tiles(x_desc, w_desc, pid_m, pid_n, ki * BK, W_NK, BM, BN)
                acc = tl.dot(a, b, acc)
        if RANK == 1:
            s, f = _ptr_tiles(s_ptr, f_ptr, offs_m, offs_n, M, N, R, W_NK, BR)
        if RANK == 3:
            s, f = _tiles(s_desc, f_desc, pid_m, pid_n, 0, W_NK, BM, BN)
        if RANK == 2:
            # Touched after the loop, so their conversion to shared memory (which waits for the loads) is
            # placed here and not next to the loads: the registers are filled while the K loop runs.
            s = tl.where(offs_m[:, None] < M, s, 0.0)
            f = tl.where(offs_n[None, :] < N, f, 0.0)
        if RANK == 1 or RANK == 2 or RANK == 3:
            acc = tl.dot(s, f, acc)
        halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        o_desc.store([pid_m * BM, pid_n * BN], left.to(out_ptr.dtype.element_ty))
        o_desc.store([pid_m * BM, pid_n * BN + BN // 2], right.to(out_ptr.dtype.element_ty))


CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_stages=3, num_warps=8)


def probe(shapes, rounds: int, reps: int, ttgir_dir: str, profile: int = 0):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for M, K, N, r in shapes:
        cases, orients = orientations(M, K, N, r)
        for orient, w_nk, act, W, s, f, (mm, nn_, kk), want, lora in orients:
            for rank in (0, 1, 2, 3, 4, 5):
                out = torch.empty(mm, nn_, device="cuda", dtype=torch.bfloat16)
                grid = (min(nsm, triton.cdiv(mm, CONFIG["BM"]) * triton.cdiv(nn_, CONFIG["BN"])),)
                kw = dict(RANK=rank, W_NK=w_nk, NUM_SMS=nsm, BR=max(16, r), **CONFIG)
                args = (act, W, s, f, out, mm, nn_, kk, r)
                ref = want + lora if rank else want
                compiled = launch_checked(_probe_rank, grid, args, kw, out, ref, f"{orient} rank{rank}")
                if compiled is None:
                    continue
                if ttgir_dir:
                    os.makedirs(ttgir_dir, exist_ok=True)
                    with open(os.path.join(ttgir_dir, f"{orient}_rank{rank}.ttgir"), "w") as fh:
                        fh.write(compiled.asm["ttgir"])
                print(f"{orient} rank{rank}: regs {compiled.n_regs} spills {compiled.n_spills} "
                      f"smem {compiled.metadata.shared}", flush=True)  # fmt: skip
                if rank == 4:  # compiled and checked only: timing it would cool the GPU for the next variant
                    continue
                cases[f"{orient}_rank{rank}"] = lambda g=grid, a=args, k=kw: _probe_rank[g](*a, **k)
        rows += rows_in_rounds((M, K, N, r), cases, rounds, reps, profile)
    return rows


def main():
    parser = probe_parser(__doc__, "probe_rank_term.json")
    parser.set_defaults(rounds=5, reps=30)
    parser.add_argument("--ttgir", default="", help="folder for each variant's TTGIR")
    parser.add_argument("--profile", type=int, default=0,
                        help="time each case as its kernels' GPU time over this many calls back to back")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    rows = probe(parse_shapes(args.shapes), args.rounds, args.reps, args.ttgir, args.profile)
    write_json(args.out, {"meta": run_meta(config=CONFIG), "rows": rows})


if __name__ == "__main__":
    main()
