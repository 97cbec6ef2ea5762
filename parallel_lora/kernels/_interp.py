"""Small launch-time helpers shared by the kernel files: dot options, seed split, per-stream workspaces."""

from __future__ import annotations

import torch
from triton.runtime import driver

from ..backend import interpreting
from ..dropout import MASK32

MAX_RANK = 256


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host-side ints (``triton.cdiv`` costs a Python call chain per use)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs that choose how ``tl.dot`` treats this dtype's tiles.

    ``UPCAST``: the interpreter's ``tl.dot`` returns garbage on bf16 operands, so when interpreting the
    tiles are cast to fp32 first; the GPU path never pays for it. ``DOT_PRECISION``: fp32 operands use
    ``"ieee"`` (not tf32) so the fp32 path matches an fp64 reference tightly; it is ignored for 16-bit.
    """
    return {
        "UPCAST": interpreting() and dtype != torch.float32,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _as_int32(v: int) -> int:
    return v - 2**32 if v >= 2**31 else v


def split_seed(seed: int) -> tuple[int, int]:
    """The 64-bit dropout seed (the key of the mask hash, ``dropout_mask.hash_tile``) as two int32 kernel
    arguments ``(lo, hi)``.

    Triton types a Python int argument by its value (i32 below 2**31, i64 above), so passing the seed
    whole would compile two kernel variants; two int32 halves (reassembled in-kernel) keep one.
    """
    if seed == 0:  # no dropout: the common case, asked by every launch
        return 0, 0
    seed = int(seed)
    return _as_int32(seed & MASK32), _as_int32((seed >> 32) & MASK32)


# Workspaces replaced by larger ones stay allocated for the life of the process. A CUDA graph captured while
# one was current replays with its address baked in: freed, the caching allocator could hand that memory to
# another tensor, which every replay would then overwrite (counters, flags, descriptors), silently.
_RETIRED: list[torch.Tensor] = []


def grown(cache: dict, key: tuple, numel: int, make) -> torch.Tensor:
    """``cache[key]`` if it holds at least ``numel`` elements, else a new ``make(numel)`` stored there; the
    one it replaces is retired, never freed (see ``_RETIRED``)."""
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = cache[key] = make(numel)
    return buf


def stream_buffer(cache: dict, device: torch.device, numel: int, dtype: torch.dtype, *, zeroed: bool) -> torch.Tensor:
    """A buffer of at least ``numel`` elements kept in ``cache`` per (device, current stream): kernels on one
    stream run one after another, so their workspaces (and counters each launch leaves at zero) can be
    shared. Grown, never shrunk, never freed (``grown``); a new one is zeroed when ``zeroed``."""
    # Triton's raw-stream query: ``torch.cuda.current_stream`` builds a Stream object at every call.
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else 0
    make = torch.zeros if zeroed else torch.empty
    return grown(cache, (device, stream), numel, lambda n: make(max(n, 1 << 10), device=device, dtype=dtype))


def pad_rank(r: int) -> int:
    """The rank tile: the next power of two >= max(r, 16) (``tl.dot`` needs dims >= 16); tails are masked."""
    return max(16, next_pow2(r))
