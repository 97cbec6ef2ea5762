"""The forward in one persistent TMA launch: ``S = c * drop_post(x A^T) [M, r]`` on the GEMM's spare programs and
``y = x W^T + b + S B^T [M, N]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import gemm_descriptors, k_loop, rank_term, shrink_rows, store_tile, tile_coords
from .dropout_mask import mask_keys
from .gemm_tma import GEMM_KEY, MAX_BLOCK_R, gemm_fits, gemm_work, tma_configs_with, tma_smem
from .host import cdiv, dot_options, interpreting, pad_rank, seed_arg, shrink_scale
from .launcher import Site, launch, output, site_buffers
from .spec import KernelSpec, adapter_bytes
from .tuning import ATOMIC_SLOT, sm_count
from .workspace import SYNC, stream_buffer

# fmt: off

MAX_FUSED_R_PAD = 64  # a larger fp32 producer tile beside the GEMM's registers would spill
MAX_FUSED_WIDE_R_PAD = 16  # adapters wider than x (fp32 over bf16) above it: the separate launches are faster
S_STAGES = 4
# An SM's multiply-add rate over its read bandwidth, in multiply-adds per byte (docs/kernels.md): set where the H100's
# fused and separate forwards cross over, 4096 bf16 output columns at 4 spare per 128 GEMM programs.
PACE = 64
PACE_TILE = (128, 256)  # the GEMM tile tuning picks on Hopper at the shapes where pace matters


def programs(x: torch.Tensor) -> int:
    """The launch's persistent programs: one per SM of x's device (3 in the interpreter)."""
    return 3 if interpreting() else sm_count(x.device.index or 0)


def spares_keep_pace(M: int, N: int, elem: int, num_programs: int, adapter_elem: int) -> bool:
    """Whether the spare programs make S as fast as the GEMM tiles use it; in one wave, whether each row block has a
    spare program or the adapters are no wider than x (``elem``, ``adapter_elem``: bytes per element)."""
    tiles = cdiv(M, PACE_TILE[0]) * cdiv(N, PACE_TILE[1])
    waves = cdiv(tiles, num_programs)
    gemm = cdiv(tiles, waves)
    if waves == 1:
        return adapter_elem <= elem or num_programs - gemm >= cdiv(M, PACE_TILE[0])
    return N * (num_programs - gemm) >= PACE * elem * gemm


def shrink_gemm_configs() -> list[triton.Config]:
    """The TMA GEMM's configs, each with the producers' K step ``S_BLOCK_K``."""
    return tma_configs_with("S_BLOCK_K", (128, 128, 128, 64))


def shrink_gemm_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # A producing tile's previous output staging (half a tile) may still be draining.
    bm, sk = cfg["BLOCK_M"], cfg["S_BLOCK_K"]
    u_tile = adapter_bytes(sk * consts["R_PAD"], consts["S_STAGES"], elem, consts, "u_ptr")
    produce = (consts["S_STAGES"] * bm * sk + bm * cfg["BLOCK_N"] // 2) * elem + u_tile
    return max(tma_smem(cfg, stages, elem, consts), produce) + ATOMIC_SLOT


@triton.jit
def _produce(
    x_ptr, u_ptr, s_ptr, flag_ptr, seen, claimed, published, pid_m, M, K_RED, R, stride_xm, stride_uk,
    stride_ur, stride_sm, stride_sr, s_scale, p, k_row, k_col, DROP_POST: tl.constexpr, R_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, S_BLOCK_K: tl.constexpr,
    S_STAGES: tl.constexpr,
):
    """Claim row block ``pid_m`` if its flag still reads ``seen`` (unclaimed), then compute and publish its S rows."""
    if seen < claimed:
        if tl.atomic_cas(flag_ptr, seen, claimed, sem="relaxed", scope="gpu") == seen:
            acc = shrink_rows(
                x_ptr, u_ptr, pid_m * BLOCK_M, M, K_RED, R, stride_xm, 1, stride_uk, stride_ur, s_scale, p, k_row,
                k_col, 0, False, False, DROP_POST, R_PAD, UPCAST, DOT_PRECISION, BLOCK_M, S_BLOCK_K, S_STAGES,
                True,
            )  # fmt: skip
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_r = tl.arange(0, R_PAD)
            s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_r[None, :] * stride_sr
            tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))
            # Every thread's stores happen before one thread's release-ordered publication.
            tl.debug_barrier()
            tl.atomic_xchg(flag_ptr, published, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["seed_salt"], do_not_specialize_on_alignment=["seed_ptr"])
def _shrink_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    u_ptr,
    s_ptr,
    f_ptr,
    out_ptr,
    sync_ptr,
    M, N_OUT, K_RED, R,
    stride_xm, stride_w, stride_uk, stride_ur, stride_sm, stride_sr, stride_fr, stride_fn, stride_om, stride_bias,
    s_scale, p, seed_ptr, seed_salt: tl.int64,
    W_NK: tl.constexpr, HAS_BIAS: tl.constexpr, DROP_POST: tl.constexpr,
    FENCE: tl.constexpr, R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, S_BLOCK_K: tl.constexpr, S_STAGES: tl.constexpr,
):
    """``sync_ptr``: int32 ``[epoch, finished programs, queue head, one flag per row block]`` of this stream."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # As many GEMM programs as keep the number of waves; the first programs (dispatched first) are spare.
    spare = programs - tl.cdiv(num_tiles, tl.cdiv(num_tiles, programs))
    # Shared scalars are read by atomics, whose result is uniform across the program: threads that read different
    # values would diverge around barriers and hang. A tile's early plain read of its flag is made uniform by a vote.
    epoch = tl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu")
    claimed = 2 * epoch + 1
    published = claimed + 1
    flags = sync_ptr + 3
    k_row, k_col = mask_keys(seed_ptr, seed_salt, DROP_POST)

    if pid < spare:
        rb = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
        while rb < num_pid_m:
            seen = tl.atomic_add(flags + rb, 0, sem="relaxed", scope="gpu")
            _produce(
                x_ptr, u_ptr, s_ptr, flags + rb, seen, claimed, published, rb, M, K_RED, R, stride_xm, stride_uk,
                stride_ur, stride_sm, stride_sr, s_scale, p, k_row, k_col, DROP_POST, R_PAD, UPCAST,
                DOT_PRECISION, BLOCK_M, S_BLOCK_K, S_STAGES,
            )  # fmt: skip
            rb = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
    else:
        x_desc, w_desc, out_desc = gemm_descriptors(x_ptr, w_ptr, out_ptr, M, N_OUT, K_RED, stride_xm, stride_w,
                                                    stride_om, W_NK, BLOCK_M, BLOCK_N, BLOCK_K)
        k_tiles = tl.cdiv(K_RED, BLOCK_K)
        for tile_id in tl.range(pid - spare, num_tiles, programs - spare):
            pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            seen = tl.load(flags + pid_m, volatile=True)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = k_loop(acc, x_desc, w_desc, pid_m, pid_n, k_tiles, W_NK, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
                         BLOCK_K)
            if FENCE:
                pending = tl.inline_asm_elementwise(
                    "{ .reg .pred p, q; setp.ne.s32 q, $1, $2; bar.red.or.pred p, 0, q; selp.s32 $0, 1, 0, p; }",
                    "=r,r,r", [seen, published], dtype=tl.int32, is_pure=False, pack=1,
                )
            else:
                pending = seen != published
            if pending:
                seen = tl.atomic_add(flags + pid_m, 0, sem="acquire", scope="gpu")
                _produce(
                    x_ptr, u_ptr, s_ptr, flags + pid_m, seen, claimed, published, pid_m, M, K_RED, R, stride_xm,
                    stride_uk, stride_ur, stride_sm, stride_sr, s_scale, p, k_row, k_col, DROP_POST, R_PAD,
                    UPCAST, DOT_PRECISION, BLOCK_M, S_BLOCK_K, S_STAGES,
                )  # fmt: skip
                # Claimed by a running program (maybe this one), which publishes without waiting on anything.
                seen = tl.atomic_add(flags + pid_m, 0, sem="acquire", scope="gpu")
                while seen != published:
                    seen = tl.atomic_add(flags + pid_m, 0, sem="acquire", scope="gpu")
            if FENCE:
                # An acquire fence after the relaxed read that saw the release: S's loads follow its stores.
                seen = tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [seen],
                                                 dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
            acc = rank_term(acc, s_ptr, f_ptr, offs_m, offs_n, M, N_OUT, R, stride_sm, stride_sr, stride_fr,
                            stride_fn, R_PAD, BLOCK_R, UPCAST, DOT_PRECISION, ".cg")  # fmt: skip
            store_tile(acc, out_desc, out_ptr, bias_ptr, pid_m, pid_n, offs_n, N_OUT, stride_bias, HAS_BIAS,
                       BLOCK_M, BLOCK_N)  # fmt: skip

    # The last program to finish resets the queue and advances the epoch for the stream's next launch.
    finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr, epoch + 1, sem="relaxed", scope="gpu")


SPEC = KernelSpec(
    name="shrink_gemm",
    configs=shrink_gemm_configs,
    key=GEMM_KEY,
    smem=shrink_gemm_smem,
    work=gemm_work,
    fits=gemm_fits,
    dtype_arg="x_ptr",
    interp={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "S_BLOCK_K": 32},
    descriptors=lambda consts: True,
)


def lora_shrink_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_nk: bool,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    *,
    p: float = 0.0,
    seed: torch.Tensor | int | None = None,
    drop_post: bool = False,
    site: Site | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [M, N], S [M, r])``: ``S = c * drop_post(x A^T)`` as ``shrink.lora_shrink``, ``y = x @ w (+ bias) + S B^T``
    (``A [r, K]``, ``B [N, r]``, ``w`` as ``gemm_tma.tma_operand`` gives W^T) for ``pad_rank(r) <= MAX_FUSED_R_PAD``."""
    M = x.shape[0]
    N, R = lora_B.shape
    dev = x.device
    y, s_lora = output(x, M, N), output(x, M, R)
    sync = site_buffers(site, dev, _sync, dev, M)
    c = shrink_scale(scale, p, drop_post)
    # A and B stand for the kernel's u = A^T and f = B^T: a launch reads their pointers, its bind their strides.
    tensors = (x, w, bias if bias is not None else y, lora_A, s_lora, lora_B, y, sync)
    runtime = (float(c), float(p), *seed_arg(seed, x))
    launch(site, tensors, runtime, _describe, x, w, w_nk, bias, lora_A, s_lora, lora_B, y, drop_post)
    return y, s_lora


def _sync(device: torch.device, M: int) -> torch.Tensor:
    """The launch's epoch, queue and row flags, for the smallest ``BLOCK_M`` (32 in the interpreter, 64 on GPU)."""
    return stream_buffer(SYNC, device, 3 + cdiv(M, 32), torch.int32, zeroed=True)


def _describe(x, w, w_nk: bool, bias, lora_A, s_lora, lora_B, y, drop_post: bool) -> tuple:
    M, K = x.shape
    u, f = lora_A.t(), lora_B.t()
    R, N = f.shape
    num_sms = programs(x)

    def build():
        r_pad = pad_rank(R)
        static = (M, N, K, R, x.stride(0), w.stride(0), *u.stride(), *s_lora.stride(), *f.stride(), y.stride(0),
                  bias.stride(0) if bias is not None else 0)
        consts = {
            "W_NK": w_nk,
            "HAS_BIAS": bias is not None,
            "DROP_POST": drop_post,
            "FENCE": not interpreting(),
            "R_PAD": r_pad,
            "BLOCK_R": min(r_pad, MAX_BLOCK_R),
            "S_STAGES": 2 if interpreting() else S_STAGES,
            **dot_options(x.dtype),
        }
        return static, lambda meta: (num_sms,), consts

    signature = (x.shape, x.stride(), w.shape, w.stride(), w_nk, None if bias is None else bias.stride(), u.shape,
                 u.stride(), f.stride(), x.dtype, u.dtype, drop_post, num_sms)
    return SPEC, _shrink_gemm_kernel, signature, build
