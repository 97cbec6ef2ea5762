"""The kernels' workspaces: per-stream buffers that launches share, and Triton's descriptor scratch.

Kernels on one stream run one after another, so the launches of one stream can share their workspaces (and the
counters each launch leaves at zero). Every buffer is kept per (device, stream), grown and never shrunk or freed.

    PARTIALS      fp32   the adapter gradients' per-split partial sums       (adapter_grads, dx_grads)
    COUNTERS      int32  their tiles' arrival counters, then dx_grads' queue (adapter_grads, dx_grads)
    SYNC          int32  the fused forward's epoch, queue and row-block flags (shrink_gemm)
    DB_PARTIALS   fp32   dB's per-row-block partials, read by the dx launch    (shrink_db -> dx_grads)
    G_PARTIALS    fp32   G's per-column-split partials                        (shrink_db)
    G_COUNTERS    int32  G's row blocks' arrival counters                      (shrink_db)
    DESCRIPTORS   int8   the device-side TMA descriptors Triton asks memory for at each launch
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from triton.runtime import driver

PARTIALS: dict[tuple, torch.Tensor] = {}
COUNTERS: dict[tuple, torch.Tensor] = {}
SYNC: dict[tuple, torch.Tensor] = {}
DB_PARTIALS: dict[tuple, torch.Tensor] = {}
G_PARTIALS: dict[tuple, torch.Tensor] = {}
G_COUNTERS: dict[tuple, torch.Tensor] = {}
DESCRIPTORS: dict[tuple, torch.Tensor] = {}

# Workspaces replaced by larger ones stay allocated for the life of the process. A CUDA graph captured while
# one was current replays with its address baked in: freed, the caching allocator could hand that memory to
# another tensor, which every replay would then overwrite (counters, flags, descriptors), silently.
RETIRED: list[torch.Tensor] = []


def grown(cache: dict, key: tuple, numel: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``cache[key]`` if it holds at least ``numel`` elements, else a new ``make(numel)`` stored there; the
    one it replaces is retired, never freed (see ``RETIRED``)."""
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            RETIRED.append(buf)
        buf = cache[key] = outside_graph_pools(lambda: make(numel))
    return buf


def outside_graph_pools(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` on a helper thread, its work finished, when CUDA is initialized and nothing is capturing.

    A workspace outlives every CUDA graph, and the memory pool of torch.compile's "reduce-overhead" graphs takes the
    allocations of its own thread only (docs/kernels.md, "Workspaces")."""
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return make()
    device, made = torch.cuda.current_device(), []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                made.append(make())
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # re-raised on the caller's thread
            made.append(e)

    thread = threading.Thread(target=run, name="parallel_lora-workspace")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def stream_buffer(cache: dict, device: torch.device, numel: int, dtype: torch.dtype, *, zeroed: bool) -> torch.Tensor:
    """A buffer of at least ``numel`` elements kept in ``cache`` per (device, current stream); a new one is
    zeroed when ``zeroed`` (counters: each launch leaves them at zero for the next)."""
    # Triton's raw-stream query: ``torch.cuda.current_stream`` builds a Stream object at every call.
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else 0
    make = torch.zeros if zeroed else torch.empty
    return grown(cache, (device, stream), numel, lambda n: make(max(n, 1 << 10), device=device, dtype=dtype))


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side descriptors live in a global workspace that Triton asks for at every launch. Kernels on one
    # stream run one after another and each writes its descriptors before reading them, so one workspace per
    # stream serves them all: a fresh ``torch.empty`` per launch costs more host time (the most on autograd's
    # device thread) than some of these kernels run for.
    if stream is None:
        return torch.empty(size, device="cuda", dtype=torch.int8)
    # Allocated on the current stream, which is ``stream``: the caching allocator reuses it in order. A
    # replaced one is kept (``grown``): a captured CUDA graph may still write descriptors there.
    key = (torch.cuda.current_device(), stream)
    return grown(DESCRIPTORS, key, size, lambda n: torch.empty(max(n, 1 << 16), device="cuda", dtype=torch.int8))


def with_descriptor_scratch(run: Callable) -> Callable:
    """``run`` with Triton's allocator set to the per-stream descriptor workspace for the call, and the caller's
    allocator (none, a user's, or another library's) back in place after it."""
    # Triton keeps its allocator in a ContextVar, which anyone may set: Inductor's launcher sets one that
    # allocates per launch, so a process that ran one compiled kernel would otherwise lose the shared workspace.
    # Setting it per call also covers autograd's device threads, which start with none.
    from triton.runtime._allocation import _allocator

    def run_with_scratch(*args):
        token = _allocator.set(_descriptor_scratch)
        try:
            return run(*args)
        finally:
            _allocator.reset(token)

    return run_with_scratch
