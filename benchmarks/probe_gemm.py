"""Probe: which structure of the persistent TMA GEMM (and of the rank reduction) runs at cuBLAS speed (CUDA).

    python benchmarks/probe_gemm.py --out probe.json

Experiments, not library code: each variant is one ``tl.constexpr`` switch of the kernels below, timed
against cuBLAS on the DESIGN shapes after a correctness check. What it settles is recorded in
``benchmarks/NOTES.md``, and the winner is what ``parallel_lora/kernels/gemm_tma.py`` implements.

GEMM switches: ``LORA`` 0 none, 1 rank-r dot in the epilogue with pointer loads, 2 rank-r dot at the tile's
start (prologue) with pointer loads, 3 epilogue with TMA loads of S and B; ``FLATTEN`` the tile and K
loops; ``SUBTILE`` the output stored as two half tiles (less shared memory).
Reduction switches: the current ``[F, M] @ [M, r]`` form against ``(g^T [r, M] @ feat [M, F])^T`` with
feat tiles through TMA, for several splits of M.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernel_breakdown import back_to_back  # benchmarks/ is this script's folder
from rounds import ratio_over_rounds, time_in_rounds  # benchmarks/ is this script's folder
from triton.testing import do_bench


@triton.jit
def _coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tiles(x_desc, w_desc, pid_m, pid_n, k, W_NK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The x tile at column ``k`` and the w tile at row ``k``, the latter as [BK, BN] (``W_NK``: read [BN, BK]
    and transposed). Also the rank-r tiles, when given the descriptors of S and B (or A) and ``k = 0``."""
    a = x_desc.load([pid_m * BM, k])
    if W_NK:
        b = w_desc.load([pid_n * BN, k]).T
    else:
        b = w_desc.load([k, pid_n * BN])
    return a, b


@triton.jit
def _probe_gemm(
    x_ptr, w_ptr, s_ptr, f_ptr, out_ptr, M, N, K, R,
    LORA: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, W_NK: tl.constexpr,
    NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    if W_NK:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BK, BN])
    if SUBTILE:
        o_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN // 2])
    else:
        o_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN])
    s_desc = tl.make_tensor_descriptor(s_ptr, [M, R], [R, 1], [BM, BR])
    if W_NK:
        f_desc = tl.make_tensor_descriptor(f_ptr, [N, R], [R, 1], [BN, BR])  # B [N, r]
    else:
        f_desc = tl.make_tensor_descriptor(f_ptr, [R, N], [N, 1], [BR, BN])  # A [r, K]: dx's N is K

    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    tile_c = start - NUM_SMS
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if LORA == 2:
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            offs_r = tl.arange(0, BR)
            s = tl.load(s_ptr + offs_m[:, None] * R + offs_r[None, :], mask=offs_r[None, :] < R, other=0.0)
            f = tl.load(f_ptr + offs_n[None, :] * R + offs_r[:, None], mask=offs_r[:, None] < R, other=0.0)
            acc = tl.dot(s, f, acc)
        for ki in range(k_tiles):
            a, b = _tiles(x_desc, w_desc, pid_m, pid_n, ki * BK, W_NK, BM, BN)
            acc = tl.dot(a, b, acc)
        tile_c += NUM_SMS
        pid_m, pid_n = _coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        if LORA == 1:
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            offs_r = tl.arange(0, BR)
            s = tl.load(s_ptr + offs_m[:, None] * R + offs_r[None, :], mask=offs_r[None, :] < R, other=0.0)
            f = tl.load(f_ptr + offs_n[None, :] * R + offs_r[:, None], mask=offs_r[:, None] < R, other=0.0)
            acc = tl.dot(s, f, acc)
        if LORA == 3:
            s = s_desc.load([pid_m * BM, 0])
            if W_NK:
                f = f_desc.load([pid_n * BN, 0]).T
            else:
                f = f_desc.load([0, pid_n * BN])
            acc = tl.dot(s, f, acc)
        if SUBTILE:
            acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            c0, c1 = tl.split(acc3)
            o_desc.store([pid_m * BM, pid_n * BN], c0.to(out_ptr.dtype.element_ty))
            o_desc.store([pid_m * BM, pid_n * BN + BN // 2], c1.to(out_ptr.dtype.element_ty))
        else:
            o_desc.store([pid_m * BM, pid_n * BN], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _probe_reduce_t(
    feat_ptr, g_ptr, out_ptr, M, F, R, m_per_split,
    BF: tl.constexpr, BM: tl.constexpr, RP: tl.constexpr,
):  # fmt: skip
    """out[split, r, F] = g[rows, :r]^T @ feat[rows, F], feat tiles through TMA."""
    pid_f = tl.program_id(0)
    pid_s = tl.program_id(1)
    f_desc = tl.make_tensor_descriptor(feat_ptr, [M, F], [F, 1], [BM, BF])
    offs_r = tl.arange(0, RP)
    acc = tl.zeros((RP, BF), dtype=tl.float32)
    m0 = pid_s * m_per_split
    for mi in tl.range(0, m_per_split // BM):
        rows = m0 + mi * BM + tl.arange(0, BM)
        ft = f_desc.load([m0 + mi * BM, pid_f * BF])
        gt = tl.load(g_ptr + rows[None, :] * R + offs_r[:, None], mask=offs_r[:, None] < R, other=0.0)
        acc = tl.dot(gt, ft, acc)
    offs_f = pid_f * BF + tl.arange(0, BF)
    tl.store(out_ptr + pid_s * R * F + offs_r[:, None] * F + offs_f[None, :], acc, mask=offs_r[:, None] < R)


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def orientations(M: int, K: int, N: int, r: int):
    """The A/B probes' operands of one shape, bf16, and their cuBLAS cases. Returns ``(cases, orients)``:
    ``cases`` the cuBLAS GEMMs ``cublas_y`` / ``cublas_dx``; ``orients`` one tuple per GEMM orientation,
    ``(orient, w_nk, act, W, s, f, (M_out, N_out, K_red), base_ref, rank_ref)``: forward (``y``: x, S, B) and dx
    (dy, G, A), with fp32 references of the base product and of the rank-r term."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    S = torch.randn(M, r, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(N, r, device="cuda", dtype=torch.bfloat16) / r**0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    G = torch.randn(M, r, device="cuda", dtype=torch.bfloat16)
    A = torch.randn(r, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    cases = {"cublas_y": lambda: F.linear(x, W), "cublas_dx": lambda: dy @ W}
    orients = []
    for orient, act, s, f in (("y", x, S, B), ("dx", dy, G, A)):
        w_nk = orient == "y"
        dims = (M, N, K) if w_nk else (M, K, N)
        base = act.float() @ (W.float().t() if w_nk else W.float())
        rank = s.float() @ (f.float().t() if w_nk else f.float())
        orients.append((orient, w_nk, act, W, s, f, dims, base, rank))
    return cases, orients


def launch_checked(kernel, grid, args: tuple, kw: dict, out: torch.Tensor, ref: torch.Tensor, name: str):
    """Compile and run one probe variant; its compiled kernel, or None (said why) if it does not compile or
    its ``out`` is off ``ref`` by 1% or more (relative Frobenius)."""
    try:
        compiled = kernel[grid](*args, **kw)
    except Exception as e:  # noqa: BLE001  (a variant that does not compile is a result too)
        print(f"{name}: FAILED {type(e).__name__}: {e}"[:400], flush=True)
        return None
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        print(f"{name}: WRONG rel err {err:.3g}", flush=True)
        return None
    return compiled


def rows_in_rounds(shape, cases: dict, rounds: int, reps: int, profile: int = 0) -> list[dict]:
    """Time every case once per round, each round led by another (``rounds.round_order``); one row per case
    with its median and its median ratio to the cuBLAS GEMM of its orientation in the same round. A case's time
    is ``do_bench``'s median over ``reps`` ms, L2 flushed before each call, or with ``profile`` its kernels' GPU
    time over that many calls back to back (``kernel_breakdown.back_to_back``)."""

    def flushed(fn) -> float:
        return do_bench(fn, warmup=10, rep=reps, return_mode="median")

    times = time_in_rounds(cases, rounds, back_to_back(profile) if profile else flushed)
    rows = []
    for name, ts in times.items():
        base = times["cublas_y" if name.startswith(("y", "cublas_y")) else "cublas_dx"]
        row = {"shape": list(shape), "variant": name, "ms": statistics.median(ts), "ratio": ratio_over_rounds(ts, base),
               "ms_rounds": ts}  # fmt: skip
        rows.append(row)
        print(f"{','.join(map(str, shape))} {name:>14}: {row['ms'] * 1e3:7.1f} us  x{row['ratio']:.3f}", flush=True)
    return rows


def probe_gemm(shapes, reps):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    configs = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8)]
    variants = [(lora, fl, st) for lora in (0, 1, 2, 3) for fl in (True, False) for st in (False, True)]
    for M, K, N, r in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        S = torch.randn(M, r, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(N, r, device="cuda", dtype=torch.bfloat16) / r**0.5
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        base = do_bench(lambda: F.linear(x, W), warmup=25, rep=reps, return_mode="median")
        base_dx = do_bench(lambda: dy @ W, warmup=25, rep=reps, return_mode="median")
        ref = (x.float() @ W.float().t() + S.float() @ B.float().t())
        ref0 = x.float() @ W.float().t()
        rows.append({"shape": [M, K, N, r], "variant": "cublas_y", "ms": base})
        rows.append({"shape": [M, K, N, r], "variant": "cublas_dx", "ms": base_dx})
        print(f"{M},{K},{N},{r} cublas_y {base * 1e3:.1f} us  cublas_dx {base_dx * 1e3:.1f} us", flush=True)
        for bm, bn, bk, stages, warps in configs:
            for lora, fl, st in variants + [("dx", True, False), ("dx", False, False)]:
                out = torch.full((M, N if lora != "dx" else K), float("nan"), device="cuda", dtype=torch.bfloat16)
                dx_mode = lora == "dx"
                mm, nn_, kk = (M, K, N) if dx_mode else (M, N, K)
                args = (dy if dx_mode else x, W, S, B, out, mm, nn_, kk, r)
                kw = dict(LORA=0 if dx_mode else lora, FLATTEN=fl, SUBTILE=st, W_NK=not dx_mode,
                          NUM_SMS=nsm, BM=bm, BN=bn, BK=bk, BR=max(16, r), GROUP_M=8,
                          num_stages=stages, num_warps=warps)  # fmt: skip
                grid = (min(nsm, triton.cdiv(mm, bm) * triton.cdiv(nn_, bn)),)
                name = f"{'dx' if dx_mode else f'lora{lora}'}_{'flat' if fl else 'nest'}{'_sub' if st else ''}"
                try:
                    _probe_gemm[grid](*args, **kw)
                    want = (dy.float() @ W.float()) if dx_mode else (ref if lora else ref0)
                    err = ((out.float() - want).norm() / want.norm()).item()
                    ms = do_bench(lambda: _probe_gemm[grid](*args, **kw), warmup=25, rep=reps, return_mode="median")
                except Exception as e:  # noqa: BLE001  (a variant that does not compile is a result too)
                    print(f"  {bm}x{bn}x{bk} s{stages} w{warps} {name}: FAILED {type(e).__name__}: {e}"[:300])
                    continue
                ratio = ms / (base_dx if dx_mode else base)
                rows.append({"shape": [M, K, N, r], "variant": name, "config": [bm, bn, bk, stages, warps],
                             "ms": ms, "ratio": ratio, "rel_err": err})  # fmt: skip
                print(f"  {bm}x{bn}x{bk} s{stages} w{warps} {name:>16}: {ms * 1e3:7.1f} us  x{ratio:.3f}  "
                      f"err {err:.1e}", flush=True)  # fmt: skip
    return rows


def probe_reduce(shapes, reps):
    rows = []
    for M, _K, N, r in shapes:
        feat = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(M, r, device="cuda", dtype=torch.bfloat16)
        ref = g.float().t() @ feat.float()
        copy = do_bench(lambda: feat.clone(), warmup=25, rep=reps, return_mode="median")
        print(f"{M},{N},{r} copy {copy * 1e3:.1f} us ({2 * feat.numel() * 2 / copy / 1e6:.0f} GB/s)", flush=True)
        for split in (8, 16, 32, 64):
            for bf, bm, stages, warps in [(128, 64, 3, 4), (128, 128, 3, 4), (256, 64, 3, 8), (64, 128, 4, 4),
                                          (256, 128, 3, 8)]:  # fmt: skip
                mps = M // split
                if mps % bm:
                    continue
                out = torch.empty(split, r, N, device="cuda", dtype=torch.float32)
                grid = (triton.cdiv(N, bf), split)
                kw = dict(BF=bf, BM=bm, RP=max(16, r), num_stages=stages, num_warps=warps)

                def fn():
                    _probe_reduce_t[grid](feat, g, out, M, N, r, mps, **kw)
                    return out.sum(0)

                try:
                    err = ((fn() - ref).norm() / ref.norm()).item()
                    ms = do_bench(fn, warmup=25, rep=reps, return_mode="median")
                    ms_k = do_bench(lambda: _probe_reduce_t[grid](feat, g, out, M, N, r, mps, **kw), warmup=25,
                                    rep=reps, return_mode="median")  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    print(f"  split {split} {bf}x{bm} s{stages} w{warps}: FAILED {type(e).__name__}: {e}"[:300])
                    continue
                gbs = feat.numel() * 2 / ms_k / 1e6
                rows.append({"shape": [M, N, r], "variant": "reduce_t", "split": split,
                             "config": [bf, bm, stages, warps], "ms_kernel": ms_k, "ms_with_sum": ms,
                             "GB_per_s": gbs, "rel_err": err})  # fmt: skip
                print(f"  split {split:>2} {bf}x{bm} s{stages} w{warps}: kernel {ms_k * 1e3:6.1f} us "
                      f"({gbs:.0f} GB/s), +sum {ms * 1e3:6.1f} us, err {err:.1e}", flush=True)  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", default="probe_gemm.json")
    parser.add_argument("--skip-gemm", action="store_true")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    shapes = [(8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16)]
    rows = probe_reduce(shapes[:2], args.reps)
    if not args.skip_gemm:
        rows += probe_gemm(shapes, args.reps)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(args.out + ".tmp", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
