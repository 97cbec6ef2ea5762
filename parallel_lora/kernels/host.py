"""Host-side arithmetic the launchers share: ceiling division, powers of two, the rank tile, dot options and
the seed's two halves."""

from __future__ import annotations

import torch

from ..backend import interpreting
from ..dropout import MASK32


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host-side ints (``triton.cdiv`` costs a Python call chain per use)."""
    return -(-a // b)


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
