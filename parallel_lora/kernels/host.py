"""Host-side arithmetic the launchers share."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, set before importing them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host-side ints, cheaper than ``triton.cdiv``."""
    return -(-a // b)


def keep_at_most(cache: dict, key: object, value: object, limit: int) -> object:
    """``cache[key] = value``, its oldest entries going while it holds more than ``limit``; returns ``value``."""
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]
    return value


def aligned_pieces(length: int, pieces: int, align: int) -> tuple[int, int]:
    """``(pieces, per_piece)``: ``length`` cut into at most ``pieces >= 1`` pieces of whole multiples of ``align``."""
    per_piece = cdiv(cdiv(length, pieces), align) * align
    return cdiv(length, per_piece), per_piece


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad_rank(r: int) -> int:
    """The rank tile: the next power of two >= max(r, 16) (``tl.dot`` needs dims >= 16); tails are masked."""
    return max(16, next_pow2(r))


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """``tl.dot``'s constexprs for ``dtype``: ``UPCAST`` (16-bit tiles to fp32, interpreter only), ``DOT_PRECISION``."""
    return {
        "UPCAST": interpreting() and dtype != torch.float32,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def keep_scale(p: float, masked: bool) -> float:
    """``1/(1-p)``, the factor of kept elements, where this launch applies the mask (``masked``), else 1."""
    return 1.0 / (1.0 - p) if masked else 1.0


def shrink_scale(scale: float, p: float, masked: bool) -> float:
    """The ``c`` of ``S = c * drop(...)``: ``scale / (1 - p)`` where this launch masks (``masked``), else ``scale``."""
    return scale / (1.0 - p) if masked else scale


ZERO_SEEDS: dict[torch.device, torch.Tensor] = {}


def seed_arg(seed: torch.Tensor | int | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A kernel's ``(seed_ptr, seed_salt)``, its seed being ``load(seed_ptr) + seed_salt``: ``(seed, 0)`` for a
    ``[1]`` int64 tensor, ``(zero, seed)`` for an int (``zero``: one ``[1]`` int64 per device, made at its first
    int), ``(fallback, 0)`` without a mask (never read)."""
    if seed is None:
        return fallback, 0
    if isinstance(seed, torch.Tensor):
        return seed, 0
    zero = ZERO_SEEDS.get(fallback.device)
    if zero is None:  # never under CUDA graph capture: check_seed refuses an int there
        zero = ZERO_SEEDS[fallback.device] = torch.zeros(1, dtype=torch.int64, device=fallback.device)
    return zero, seed
