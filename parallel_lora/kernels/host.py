"""Host-side arithmetic the launchers share: whether Triton interprets, ceiling division, powers of two, the rank
tile, dot options, the dropout scales and the seed pointer."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton fixes the mode of each ``@triton.jit`` when it is defined, so set it before importing
    ``parallel_lora.kernels``; read at every call (the kernels ask only at a launch layout's first call).
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host-side ints (``triton.cdiv`` costs a Python call chain per use)."""
    return -(-a // b)


def keep_at_most(cache: dict, key: object, value: object, limit: int) -> object:
    """``cache[key] = value``, its oldest entries going while it holds more than ``limit``; returns ``value``."""
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]
    return value


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad_rank(r: int) -> int:
    """The rank tile: the next power of two >= max(r, 16) (``tl.dot`` needs dims >= 16); tails are masked."""
    return max(16, next_pow2(r))


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


def keep_scale(p: float, masked: bool) -> float:
    """``1/(1-p)``, the factor of the elements a mask keeps, where this launch applies the mask (``masked``), else
    1: the kernels only zero the dropped elements and scale by this once."""
    return 1.0 / (1.0 - p) if masked else 1.0


def shrink_scale(scale: float, p: float, masked: bool) -> float:
    """The factor ``c`` of ``S = c * drop(...)``: ``scale / (1 - p)`` where this launch applies the mask (``masked``),
    else ``scale``; ``keep_scale`` folded into ``scale`` once."""
    return scale / (1.0 - p) if masked else scale


def seed_arg(seed: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """A kernel's ``seed_ptr`` argument: the call's seed (``[1]`` int64 on the launch's device), read in device
    memory once per program (``dropout_mask.mask_keys``), so one compiled kernel serves every seed and a CUDA graph
    replays with the seed of each replay; without a mask, ``fallback`` (a tensor of the launch), never read."""
    return fallback if seed is None else seed
