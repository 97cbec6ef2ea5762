"""Choosing each launch's config on the GPU, at its first call.

A launch is tuned per kernel variant (its constexprs), size bucket (the token count M rounded up to a power of
two) and tensor dtypes. ``prune`` first drops the configs whose estimated shared memory (``KernelSpec.smem``,
checked to bound what Triton compiles for sm_90a) exceeds the device's opt-in limit, so the same lists also fit
a ~100 KB GPU, and tiles much larger than the problem; a problem under ``SMALL_WORK`` multiply-adds keeps one
config. ``tune`` times the rest back to back in CUDA graphs, in interleaved rounds (not one config after the
other, as Triton's autotuner does: ``fastest`` says why), and keeps the fastest.
Tuning cannot run inside CUDA-graph capture: run one step eagerly first. The interpreter never tunes (each
kernel runs its ``KernelSpec.interp`` config).
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import triton

from .host import next_pow2

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction

    from .launcher import KernelSpec

# A launch grid, as Triton takes it: a tuple, or a function of the config's meta-parameters.
Grid = Callable[[dict], tuple[int, ...]] | tuple[int, ...]


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
    """Streaming multiprocessors of CUDA device ``device_index`` (cached: launchers ask at first calls)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Below this many multiply-adds (512^3) a launch takes one small config instead of autotuning.
SMALL_WORK = 2**27

# Shared memory a scalar atomic takes to broadcast its result (the kernels' arrival counts and queues), for the
# estimates: 16 B past the tile buffers compiled for sm_90; one 128 B line allowed.
ATOMIC_SLOT = 128


def prune(
    spec: KernelSpec, configs: list[triton.Config], nargs: dict, smem_limit: int | None = None, **consts
) -> list[triton.Config]:
    """Keep the configs within the device's shared memory and the problem's size.

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
    the lower index. Round ``k`` times every candidate once, starting at candidate ``k mod n``: a kernel timed
    first, on a cooler GPU, or right after a slow one, can read fast, and Triton's autotuner times its
    configs one after the other, in list order, so the same candidate would always have that place."""
    times: list[list[float]] = [[] for _ in range(n)]
    for k in range(rounds):
        for j in range(n):
            times[(k + j) % n].append(time_one((k + j) % n))
    return min(range(n), key=lambda i: (statistics.median(times[i]), i))


# One side stream per device for the tuning graphs (per-stream workspaces are keyed by stream).
_TUNE_STREAMS: dict[int, torch.cuda.Stream] = {}


def replay_timer(call: Callable[[], object]) -> Callable[[], float]:
    """A timer of ``call`` (one launch, already compiled): ms per launch over one replay of a CUDA graph of
    back-to-back launches. No host time between launches and no cache flush: ``triton.testing.do_bench`` adds an
    L2 flush and a Python launch to every call, which swamp the differences between the configs of a short
    kernel. Captured in thread-local mode: another thread's CUDA calls meanwhile (autograd's device threads) are
    not disturbed."""
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


def tune(spec: KernelSpec, kernel: JITFunction, grid: Grid, args: tuple, consts: dict) -> triton.Config:
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


# ``best_key`` (kernel, constexprs, device, bucketed sizes, tensor dtypes) -> the config ``tune`` chose for the
# first token count M of that bucket.
_BEST: dict[tuple, triton.Config] = {}
_TUNING_LOCK = threading.Lock()


@functools.cache
def _key_positions(spec: KernelSpec, kernel: JITFunction) -> tuple[int, ...]:
    return tuple(kernel.arg_names.index(k) for k in spec.key)


def bucketed_sizes(spec: KernelSpec, kernel: JITFunction, args: tuple) -> tuple[int, ...]:
    """The key sizes of a launch with the token count ``M`` (always first) rounded up to a power of two:
    variable-length batches would otherwise retune at every new length (a compile and a timing of every
    candidate config, seconds each). The other sizes are a layer's own and stay exact."""
    m, *rest = (args[i] for i in _key_positions(spec, kernel))
    return (next_pow2(m), *rest)


def best_key(spec: KernelSpec, kernel: JITFunction, args: tuple, consts: dict) -> tuple:
    """The ``_BEST`` key of a launch: its kernel and constexprs (each variant tunes its own config: one compiled
    with the "pre" mask has other registers and shared memory than the plain one), device, size bucket and
    tensor dtypes."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (spec.name, kernel.__name__, tensors[0].device, bucketed_sizes(spec, kernel, args),
            tuple(t.dtype for t in tensors), tuple(consts.items()))  # fmt: skip


def launch_tuned(
    spec: KernelSpec, kernel: JITFunction, grid: Grid, args: tuple, consts: dict
) -> tuple[triton.compiler.CompiledKernel, triton.Config]:
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
