"""Launch configurations for the LoRA kernels: one config generator per kernel, a shared-memory prune, and
the single launch path that picks the interpreter config or the tuned one.

On GPU each launch's config is tuned at its first call, per kernel variant (constexprs), size bucket and
tensor dtypes (``tune``). First ``prune`` drops configs whose estimated shared memory, ``stages * (tiles
streamed per step) * elem_size`` plus the rank-r tiles, exceeds the device's opt-in limit, so the same lists
also fit a ~100 KB GPU, and drops tiles much larger than the problem; a problem under ``SMALL_WORK``
multiply-adds keeps one config (no tuning). The rest are timed back to back in CUDA graphs, in interleaved
rounds: Triton's autotuner (``do_bench``, one config after the other) picked a dx launch 7% slower than the
best in 3 of 17 recorded H200 runs.
The estimates were checked to bound ``metadata.shared`` of every config compiled for sm_90 (Triton 3.9).
The Triton interpreter cannot autotune over several configs, so there each kernel runs with exactly one
small config.

Tile lists follow Triton's matmul tutorial for the GEMM; they are a correctness-first starting set (not yet
tuned on the H200; a later issue records shapes and gains beside any tuned constant).
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from ._interp import interpreting, next_pow2


@functools.cache
def max_shared_mem(device_index: int) -> int:
    """Opt-in shared memory per block, in bytes, of CUDA device ``device_index``."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem:
        return int(smem)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (cached: the launch path asks every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ---------------------------------------------------------------------------------------------------------
# Per-kernel config generators and shared-memory estimates.
# ---------------------------------------------------------------------------------------------------------


def gemm_configs() -> list[triton.Config]:
    """Base GEMM + fused rank-r term: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), from the matmul tutorial."""
    rows = [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 64, 32, 5, 2),
        (64, 64, 32, 2, 4),  # the fallback that fits ~100 KB even for fp32 at r = 256
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in rows
    ]


def gemm_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The K loop streams an x tile and a W tile per stage; the rank-r tiles (S|G and B|A) are one more
    # buffer, or a pipelined loop of their own (``stages`` buffers) when the rank takes several chunks.
    # Checked against sm_90 compiles (Triton 3.9): an upper bound on ``metadata.shared`` for every config.
    bm, bn, bk, br = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], consts["BLOCK_R"]
    rank_buffers = stages if consts["R"] > br else 1
    return (stages * (bm * bk + bk * bn) + rank_buffers * (bm + bn) * br) * elem


# Both GEMM kernels: autotune key, multiply-adds, and the rank chunk (r = 256 in one chunk would double
# the shared-memory footprint of a 128x128 tile).
GEMM_KEY = ("M", "N_OUT", "K_RED", "R")
MAX_BLOCK_R = 64


def gemm_work(n: dict) -> int:
    return n["M"] * n["N_OUT"] * (n["K_RED"] + n["R"])


def gemm_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_M"] <= max(64, next_pow2(nargs["M"])) and cfg["BLOCK_N"] <= max(
        64, next_pow2(nargs["N_OUT"])
    )


def gemm_tma_configs() -> list[triton.Config]:
    """The persistent TMA GEMM (Hopper): (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). 128x256x64 in 3 stages
    with 8 warps is the shape that matched cuBLAS in the issue's probe. A 4th stage of it fits beside the rank tiles
    only with the output tile stored in quarters, and an H100 timed that no faster (NOTES.md, session 23)."""
    rows = [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (64, 64, 64, 3, 4),  # the fallback that fits ~100 KB (sm_120-class parts have TMA but less smem)
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in rows
    ]


def gemm_tma_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Per stage one x and one w tile and the 8-byte mbarrier its TMA loads arrive on; half the output tile is
    # staged in shared memory for its TMA store; the rank-r tiles of one chunk go through shared memory on their
    # way to the tensor cores. (Without the barriers the "pre"-dropout dx GEMM compiled 24 B past the estimate on
    # sm_90a, Triton 3.6 and 3.9: benchmarks/compile_check.py.)
    # Rank tiles through TMA (``RANK_TMA``, one chunk) add an mbarrier for each of their two loads.
    bm, bn, bk, br = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], consts["BLOCK_R"]
    rank_barriers = 16 if consts.get("RANK_TMA") else 0
    return (stages * (bm + bn) * bk + bm * bn // 2 + (bm + bn) * br) * elem + stages * 8 + rank_barriers


def _with_spare_work(name: str, values: Sequence[int]) -> list[triton.Config]:
    """The TMA GEMM's configs, row by row, each with ``name``: a tile size of the work its spare programs do."""
    return [
        triton.Config({**c.kwargs, name: v}, num_stages=c.num_stages, num_warps=c.num_warps)
        for c, v in zip(gemm_tma_configs(), values, strict=True)
    ]


def dx_grads_configs() -> list[triton.Config]:
    """The backward's fused launch (``dx_grads``): the TMA GEMM's tiles, each with the column width
    ``RED_BLOCK_F`` of the adapter-gradient tiles its spare programs reduce (their M tile and stages are chosen
    from the rank, ``dx_grads.red_tiles``). The fallback row fits ~100 KB like the GEMM's."""
    return _with_spare_work("RED_BLOCK_F", (128, 128, 128, 32))


def dx_grads_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The GEMM loop and the reduction loop run one after the other, so their buffers share shared memory:
    # the larger of the two, plus the queue's and the arrival counter's atomic slots.
    red = {"BLOCK_F": cfg["RED_BLOCK_F"], "BLOCK_M": consts["RED_BLOCK_M"]}
    # An explicitly staged TMA loop allocates ``RED_STAGES`` buffers on Triton 3.6 (stages - 1 on 3.9).
    red_smem = reduce_smem(red, consts["RED_STAGES"], elem, consts)
    return max(gemm_tma_smem(cfg, stages, elem, consts), red_smem) + ATOMIC_SLOT


def shrink_gemm_configs() -> list[triton.Config]:
    """The forward's fused launch (``shrink_gemm``): the TMA GEMM's tiles, each with the K step ``S_BLOCK_K`` of
    the S rows its spare programs produce (``BLOCK_M`` rows at a time). The fallback row fits ~100 KB."""
    return _with_spare_work("S_BLOCK_K", (128, 128, 128, 64))


def shrink_gemm_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # The producers' loop (x and A^T tiles, ``S_STAGES`` buffers) and the GEMM's run in different programs or one
    # after the other, so they share shared memory: the larger of the two, plus the atomics' slot. A tile that
    # produces its own S does so while its previous tile's output staging (half a tile) may still be draining
    # (measured on sm_90, Triton 3.6: 163864 B at 128 x 128, r = 16).
    bm, sk = cfg["BLOCK_M"], cfg["S_BLOCK_K"]
    produce = (consts["S_STAGES"] * (bm * sk + sk * consts["R_PAD"]) + bm * cfg["BLOCK_N"] // 2) * elem
    return max(gemm_tma_smem(cfg, stages, elem, consts), produce) + ATOMIC_SLOT


def shrink_configs() -> list[triton.Config]:
    """Rank-r shrink ``[M, K] @ [K, r]``: (BLOCK_M, BLOCK_K, stages, warps); the rank tile is R_PAD.

    The shrink is bandwidth-bound (it reads x once), so the list favours many programs (small BLOCK_M:
    M = 8192 rows make 256-512 programs for 132 SMs) with deep, wide K tiles in flight."""
    rows = [
        (32, 32, 2, 4),  # the fallback that fits ~100 KB even for fp32 at r = 256
        (16, 128, 4, 4),
        (16, 256, 3, 4),
        (32, 128, 4, 4),
        (32, 256, 3, 4),
        (32, 256, 4, 8),
        (64, 64, 4, 4),
        (64, 128, 3, 4),
        (64, 128, 4, 8),
        (128, 64, 3, 8),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_stages=s, num_warps=w) for bm, bk, s, w in rows]


def shrink_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Per stage an x and a U tile. Under the "pre" mask the masked x tile is written back to shared memory for
    # the tensor cores by Triton 3.8 (one more x tile: compiled exactly that at 64x64, 64x128 and 128x64 for
    # sm_90a), while 3.6 and 3.9 feed it from registers; the estimate takes the larger, since pruning trusts it.
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    staged = bm * bk if consts["DROP_PRE"] else 0
    return (stages * (bm * bk + bk * consts["R_PAD"]) + staged) * elem


def shrink_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_M"] <= max(32, next_pow2(nargs["M"]))


def shrink_db_configs() -> list[triton.Config]:
    """The backward's shrink with dB's partials (``shrink_db``): (BLOCK_N, stages, warps); the rows per program
    are fixed (``shrink_db.db_rows``), not tuned, so that dB's partials sum in one order."""
    rows = [
        (32, 2, 4),  # the fallback that fits ~100 KB
        (64, 3, 4),
        (64, 3, 8),
        (64, 4, 8),
        (128, 2, 8),
        (128, 3, 8),
    ]
    return [triton.Config({"BLOCK_N": bn}, num_stages=s, num_warps=w) for bn, s, w in rows]


def shrink_db_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    # Per stage a dy tile and a B tile; S's rows once (the second dot's operand); the fp32 partial of dB on its
    # way to a coalesced store (sm_90a, Triton 3.6: 4 KB past the tiles at BLOCK_N 64), and the arrival's atomic.
    rows, bn, r_pad = consts["ROWS"], cfg["BLOCK_N"], consts["R_PAD"]
    return (stages * (rows * bn + bn * r_pad) + rows * r_pad) * elem + bn * r_pad * 4 + ATOMIC_SLOT


def reduce_configs() -> list[triton.Config]:
    """Adapter gradients, reductions over M ``[F, M] @ [M, r]``: (BLOCK_F, BLOCK_M, stages, warps).
    Bandwidth-bound like the shrink: the split over M (``rank_reduce.split_rows``) supplies the programs."""
    rows = [
        (32, 32, 2, 4),  # the fallback that fits ~100 KB even for fp32 at r = 256
        (64, 64, 4, 4),
        (64, 128, 3, 4),
        (64, 128, 4, 4),
        (128, 64, 3, 4),
        (128, 64, 4, 8),
        (128, 128, 3, 8),
        (256, 64, 3, 8),
    ]
    return [triton.Config({"BLOCK_F": bf, "BLOCK_M": bm}, num_stages=s, num_warps=w) for bf, bm, s, w in rows]


# Shared memory a scalar atomic takes to broadcast its result (the adapter-gradient kernel's arrival count):
# measured 16 B past the tile buffers on sm_90 (Triton 3.6); one 128 B line allowed.
ATOMIC_SLOT = 128


def reduce_smem(cfg: dict, stages: int, elem: int, consts: dict) -> int:
    return stages * cfg["BLOCK_M"] * (cfg["BLOCK_F"] + consts["R_PAD"]) * elem + ATOMIC_SLOT


def reduce_fits(cfg: dict, nargs: dict) -> bool:
    return cfg["BLOCK_F"] <= max(64, next_pow2(max(nargs["F_A"], nargs["F_B"])))


# The largest BLOCK_M in ``reduce_configs`` (GPU) / the interpreter's BLOCK_M: a split of the M reduction
# must be a whole number of M tiles for every config, so its length is a multiple of this.
REDUCE_M_ALIGN_GPU = 128
REDUCE_M_ALIGN_INTERP = 32

# Below this many multiply-adds (512^3) a launch takes one small config instead of autotuning.
SMALL_WORK = 2**27

INTERP_CONFIGS = {
    "gemm": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4},
    "gemm_tma": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2},
    "shrink": {"BLOCK_M": 32, "BLOCK_K": 32},
    "reduce": {"BLOCK_F": 32, "BLOCK_M": 32},
    "shrink_db": {"BLOCK_N": 32},
    "dx_grads": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "RED_BLOCK_F": 32},
    "shrink_gemm": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "S_BLOCK_K": 32},
}


# ---------------------------------------------------------------------------------------------------------
# The launch path.
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """How to launch one kernel: its configs, autotune key, smem estimate and shape filter."""

    name: str
    configs: Callable[[], list[triton.Config]]
    key: Sequence[str]  # autotune key, the token count "M" first
    smem: Callable[[dict, int, int, dict], int]  # (config kwargs, stages, elem size, sizes + constexprs)
    fits: Callable[[dict, dict], bool]
    work: Callable[[dict], int]  # multiply-adds of the launch, from its size arguments
    dtype_arg: str  # a tensor argument whose element size and device stand for all operands

    def __post_init__(self):
        if self.key[0] != "M":
            raise ValueError(f"{self.name}: the autotune key must start with the token count M, got {self.key}")


def prune(spec: KernelSpec, configs, nargs: dict, smem_limit: int | None = None, **consts):
    """``early_config_prune``: keep configs within the device's shared memory and the problem's size.

    Never returns an empty list: if nothing fits, the config with the smallest estimate is kept.
    """
    ref = nargs[spec.dtype_arg]
    if smem_limit is None:
        smem_limit = max_shared_mem(ref.device.index if ref.device.index is not None else 0)
    elem = ref.element_size()

    sizes = {**nargs, **consts}

    def need(c):
        return spec.smem(c.kwargs, c.num_stages, elem, sizes)

    fitting = [c for c in configs if need(c) <= smem_limit]
    sized = [c for c in fitting if spec.fits(c.kwargs, nargs)]
    kept = sized or fitting or [min(configs, key=need)]
    if spec.work(nargs) < SMALL_WORK:
        # Tuning a problem this small costs more (one compile per config) than it could ever save.
        return [min(kept, key=need)]
    return kept


# How ``tune`` times a candidate config: the median over ``TUNE_ROUNDS`` rounds, each a CUDA-graph replay of
# ~``TUNE_REPLAY_MS`` of back-to-back launches.
TUNE_ROUNDS = 5
TUNE_REPLAY_MS = 5.0


def fastest(n: int, time_one: Callable[[int], float], rounds: int = TUNE_ROUNDS) -> int:
    """The index (of ``n`` candidates) with the lowest median of ``time_one(i)`` over ``rounds`` rounds; ties go to
    the lower index. Round ``k`` times every candidate once, starting at candidate ``k mod n``: on the H200 a
    kernel timed first, on a cooler GPU, or right after a slow one, read up to 10-20% fast (NOTES.md, sessions 9
    and 13), and Triton's autotuner times its configs one after the other, in list order."""
    times: list[list[float]] = [[] for _ in range(n)]
    for k in range(rounds):
        for j in range(n):
            times[(k + j) % n].append(time_one((k + j) % n))
    return min(range(n), key=lambda i: (statistics.median(times[i]), i))


# One side stream per device for the tuning graphs (per-stream workspaces are keyed by stream).
_TUNE_STREAMS: dict[int, torch.cuda.Stream] = {}


def replay_timer(call: Callable[[], object]) -> Callable[[], float]:
    """A timer of ``call`` (one launch, already compiled): ms per launch over one replay of a CUDA graph of
    back-to-back launches. No host time between launches and no cache flush: ``triton.testing.do_bench`` adds a
    256 MB L2 flush and a Python launch to every call, ~50 us that swamped the 1-2 us between the configs of an
    ~20 us kernel and diluted a 27 us gap between two 380 us ones (NOTES.md, session 17). Captured in
    thread-local mode: another thread's CUDA calls meanwhile (autograd's device threads) are not disturbed."""
    device = torch.cuda.current_device()
    if device not in _TUNE_STREAMS:
        _TUNE_STREAMS[device] = torch.cuda.Stream(device)
    stream = _TUNE_STREAMS[device]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(3):
            call()
        end.record()
        end.synchronize()
        calls = max(1, min(1000, int(TUNE_REPLAY_MS / max(start.elapsed_time(end) / 3, 1e-3))))
        # ``capture_begin`` itself: ``torch.cuda.graph`` would also collect garbage and empty the allocator's
        # cache for every candidate.
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                call()
        finally:
            graph.capture_end()

    def time_one() -> float:
        with torch.cuda.stream(stream):
            start.record()
            graph.replay()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    return time_one


def tune(spec: KernelSpec, kernel, grid, args: tuple, consts: dict) -> triton.Config:
    """The fastest of the configs ``prune`` keeps for this launch, each compiled and timed by ``replay_timer`` in
    interleaved rounds (``fastest``). A config the compiler refuses (resources the estimate missed) is
    skipped. Runs the kernel many times on ``args``: the launches write its outputs, never accumulate."""
    from triton.runtime.errors import OutOfResources

    nargs = dict(zip(kernel.arg_names, args, strict=False))
    candidates = prune(spec, spec.configs(), nargs, **consts)
    if len(candidates) == 1:
        return candidates[0]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{spec.name}: the first launch of a layer shape times {len(candidates)} candidate configs of its "
            "kernel, which cannot happen inside CUDA graph capture. Run one step eagerly (same shapes and "
            "dtypes) before capturing."
        )
    # Nothing else of ours may run meanwhile: the fused launches' sync buffers belong to the caller's stream.
    torch.cuda.current_stream().synchronize()
    timers, kept = [], []
    for cfg in candidates:
        call = functools.partial(kernel[grid], *args, **consts, **cfg.all_kwargs())
        try:
            call()
        except OutOfResources:
            continue
        timers.append(replay_timer(call))
        kept.append(cfg)
    if not kept:
        raise RuntimeError(f"{spec.name}: no config of {candidates} compiles for this launch")
    return kept[fastest(len(kept), lambda i: timers[i]())]


def tuned_summary() -> dict[str, list[str]]:
    """Every tuned launch's chosen config per key, for benchmark logs."""
    summary: dict[str, list[str]] = {}
    for (name, _, _, sizes, dtypes, consts), cfg in _BEST.items():
        flags = {k: v for k, v in consts if isinstance(v, bool) and v}
        key = (*sizes, *(str(d) for d in dtypes))
        summary.setdefault(name, []).append(
            f"{key} {flags}: {cfg.kwargs} stages={cfg.num_stages} warps={cfg.num_warps}"
        )
    return summary


@dataclass(frozen=True)
class Bound:
    """A kernel bound to one launch signature: its compiled kernel called at a fixed grid, the size and stride
    arguments, and the constexpr tail (the call's constexprs and the tuned config). Under the interpreter,
    ``run`` calls the kernel through Triton with the one interpreter config, and there is no compiled kernel."""

    name: str  # the KernelSpec's name
    run: Callable  # the compiled kernel's runner at this grid
    static: tuple  # the sizes and strides, between the tensors and the runtime scalars
    tail: tuple  # constexpr values, in the kernel's argument order after the runtime scalars
    compiled: triton.compiler.CompiledKernel | None
    consts: dict  # the call's constexprs
    config: triton.Config | None  # the tuned config it was compiled with

    def launch(self, tensors: tuple, runtime: tuple) -> None:
        """Launch on new tensors of the bound layout (only their addresses are read) and runtime scalars."""
        self.run(*tensors, *self.static, *runtime, *self.tail)


class Site:
    """One launch of an op (``kernels.lora``) for one operand layout: the wrapper fills it at the layout's first
    call (``bound``, plus the wrapper's own layout-derived choices in ``info``) and at later calls launches
    ``bound`` directly, skipping its signature, its checks and the ``_BOUND`` lookup."""

    __slots__ = ("bound", "info")

    def __init__(self):
        self.bound: Bound | None = None
        self.info: tuple = ()


# (spec, kernel, device, signature, tensors' 16-byte alignment) -> Bound. Triton's own launch path re-binds
# and re-specializes every argument at each call (60-100 us of host time per launch on the H200 machine's CPU,
# measured with the ``triton.autotune`` wrapper used until session 17; more than the small kernels run for);
# after a signature's first launch we call its compiled kernel directly. One entry per exact shape: a new
# token count costs one launch through Triton's path (its binary is shared by the Ms Triton specializes alike;
# its config by the bucket). Two threads binding one signature at once store equal entries.
_BOUND: dict[tuple, Bound] = {}
# ``best_key`` (kernel, constexprs, device, bucketed sizes, tensor dtypes) -> the config ``tune`` chose for the
# first token count M of that bucket.
_BEST: dict[tuple, triton.Config] = {}
_TUNING_LOCK = threading.Lock()


@functools.cache
def _key_positions(spec: KernelSpec, kernel) -> tuple[int, ...]:
    return tuple(kernel.arg_names.index(k) for k in spec.key)


def bucketed_sizes(spec: KernelSpec, kernel, args: tuple) -> tuple[int, ...]:
    """The key sizes of a launch with the token count ``M`` (always first) rounded up to a power of two:
    variable-length batches would otherwise retune at every new length (a compile and a timing of every
    candidate config, seconds each). The other sizes are a layer's own and stay exact."""
    m, *rest = (args[i] for i in _key_positions(spec, kernel))
    return (next_pow2(m), *rest)


def _compile(spec: KernelSpec, kernel, grid, args: tuple, consts: dict):
    """Launch through Triton's own path with the config tuned for this size bucket (``tune`` at the bucket's
    first launch); returns ``(compiled kernel, config)``."""
    key = best_key(spec, kernel, args, consts)
    # Under the lock: autograd's device thread may launch the same kernel for another signature at the same
    # time, and one tuning at a time keeps the timings clean.
    with _TUNING_LOCK:
        cfg = _BEST.get(key)
        if cfg is None:
            cfg = _BEST[key] = tune(spec, kernel, grid, args, consts)
        compiled = kernel[grid](*args, **consts, **cfg.all_kwargs())
    return compiled, cfg


def best_key(spec: KernelSpec, kernel, args: tuple, consts: dict) -> tuple:
    """The ``_BEST`` key of a launch: its kernel and constexprs (each variant tunes its own config: one compiled
    with the "pre" mask has other registers and shared memory than the plain one), device, size bucket and
    tensor dtypes."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (spec.name, kernel.__name__, tensors[0].device, bucketed_sizes(spec, kernel, args),
            tuple(t.dtype for t in tensors), tuple(consts.items()))  # fmt: skip


def bound_key(spec: KernelSpec, kernel, signature: tuple, tensors: tuple) -> tuple:
    """The ``_BOUND`` key of a launch on the current device."""
    # Triton specializes pointer arguments on 16-byte alignment: a misaligned view needs its own binary.
    return (spec.name, kernel.__name__, torch.cuda.current_device(), signature,
            tuple([t.data_ptr() % 16 == 0 for t in tensors]))  # fmt: skip


def launch(spec: KernelSpec, kernel, signature: tuple, tensors: tuple, runtime: tuple, build: Callable) -> Bound:
    """Launch ``kernel(*tensors, *static, *runtime, *constexprs)``; returns the ``Bound`` it launched.

    ``tensors`` are the pointer arguments (first in the kernel's signature), ``runtime`` the scalars it never
    specializes on (floats and ``do_not_specialize`` ints: dropout p and seed, scale, offsets; last).
    ``signature`` is the caller's cheap summary of everything else (sizes, strides, dtypes, constexpr flags):
    two calls with equal signatures must get equal ``build()`` results. ``build() -> (static, grid, consts)``
    gives the size and stride arguments, the grid (a function of the config) and the call's constexprs; it
    runs at a signature's first launch only. On GPU that launch tunes (per size bucket, ``bucketed_sizes``:
    ``tune``) and binds the compiled kernel; later launches call it directly. The interpreter runs
    the one small config of ``INTERP_CONFIGS``.
    """
    if interpreting():
        static, grid, consts = build()
        cfg = INTERP_CONFIGS[spec.name]

        def run(*args):
            kernel[grid](*args, **consts, **cfg)

        bound = Bound(spec.name, run, static, (), None, consts, None)
        bound.launch(tensors, runtime)
        return bound
    key = bound_key(spec, kernel, signature, tensors)
    bound = _BOUND.get(key)
    if bound is not None:
        bound.launch(tensors, runtime)
        return bound
    static, grid, consts = build()
    args = (*tensors, *static, *runtime)
    compiled, cfg = _compile(spec, kernel, grid, args, consts)
    if not isinstance(compiled, triton.compiler.CompiledKernel):
        # A Triton that hands back no compiled kernel: later calls of this Bound go through its own path.
        run = lambda *a: kernel[grid](*a, **consts, **cfg.all_kwargs())  # noqa: E731
        return Bound(spec.name, run, static, (), None, consts, cfg)
    meta = {**consts, **cfg.kwargs}
    tail = tuple(meta[name] for name in kernel.arg_names[len(args) :])
    g = grid(meta) if callable(grid) else grid
    g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
    bound = _BOUND[key] = Bound(spec.name, compiled[g], static, tail, compiled, consts, cfg)
    return bound
