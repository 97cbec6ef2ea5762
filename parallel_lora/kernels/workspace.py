"""The launches' per-(device, stream) workspaces, grown and never freed, and Triton's TMA descriptor scratch;
docs/kernels.md tabulates them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

PARTIALS: dict[tuple, torch.Tensor] = {}
COUNTERS: dict[tuple, torch.Tensor] = {}
SYNC: dict[tuple, torch.Tensor] = {}
DB_PARTIALS: dict[tuple, torch.Tensor] = {}
G_PARTIALS: dict[tuple, torch.Tensor] = {}
G_COUNTERS: dict[tuple, torch.Tensor] = {}
DESCRIPTORS: dict[tuple, torch.Tensor] = {}

_CACHES = (PARTIALS, COUNTERS, SYNC, DB_PARTIALS, G_PARTIALS, G_COUNTERS, DESCRIPTORS)

# Replaced workspaces, kept: a captured CUDA graph may still write to their addresses.
RETIRED: list[torch.Tensor] = []


def holding(address: int) -> torch.Tensor | None:
    """The workspace, kept or retired, whose memory holds ``address``; None if none does."""
    for buf in (*RETIRED, *(b for cache in _CACHES for b in cache.values())):
        start = buf.data_ptr()
        if start <= address < start + buf.numel() * buf.element_size():
            return buf
    return None


def grown(cache: dict, key: tuple, numel: int, make: Callable, least: int, device, dtype: torch.dtype) -> torch.Tensor:
    """``cache[key]`` if it holds ``numel`` elements, else a new ``make(max(numel, least))`` there, the old retired."""
    buf = cache.get(key)
    if buf is not None and buf.numel() >= numel:  # every call but a key's first or a growth
        return buf
    if buf is not None:
        RETIRED.append(buf)
    buf = cache[key] = outside_graph_pools(lambda: make(max(numel, least), device=device, dtype=dtype))
    return buf


def outside_graph_pools(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` on a helper thread, outside any graph's memory pool, unless nothing is initialized or capturing."""
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return make()
    device, made = torch.cuda.current_device(), []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                made.append(make())
                torch.cuda.current_stream().synchronize()
        except BaseException as e:
            made.append(e)

    thread = threading.Thread(target=run, name="parallel_lora-workspace")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def stream_buffer(cache: dict, device: torch.device, numel: int, dtype: torch.dtype, *, zeroed: bool) -> torch.Tensor:
    """A buffer of ``numel`` or more elements in ``cache`` per (device, current stream), zero when new if ``zeroed``."""
    # The raw handle: ``torch.cuda.current_stream`` builds a Stream object, Triton's driver proxy adds lookups.
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    return grown(cache, key, numel, torch.zeros if zeroed else torch.empty, 1 << 10, device, dtype)


def descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator contract: ``size`` bytes for a launch's TMA descriptors, the stream's workspace."""
    if stream is None:
        return torch.empty(size, device="cuda", dtype=torch.int8)
    key = (torch._C._cuda_getDevice(), stream)  # torch.cuda.current_device() without its Python wrapper
    return grown(DESCRIPTORS, key, size, torch.empty, 1 << 16, "cuda", torch.int8)


def with_descriptor_scratch(run: Callable, descriptors: bool = True) -> Callable:
    """``run`` with Triton's allocator set to the descriptor workspace for each call, the caller's restored after;
    ``run`` itself for a kernel that makes no ``descriptors``."""
    if not descriptors:
        return run
    from triton.runtime._allocation import _allocator

    def run_with_scratch(*args):
        token = _allocator.set(descriptor_scratch)
        try:
            return run(*args)
        finally:
            _allocator.reset(token)

    return run_with_scratch
