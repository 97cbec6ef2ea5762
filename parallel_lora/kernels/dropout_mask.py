"""The dropout keep-mask in Triton, bit for bit ``parallel_lora._dropout.hash_uniform`` (docs/kernels.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._dropout import FMIX_M1, FMIX_M2, GOLDEN32

_FMIX_M1 = tl.constexpr(FMIX_M1)
_FMIX_M2 = tl.constexpr(FMIX_M2)
_GOLDEN32 = tl.constexpr(GOLDEN32)


@triton.jit
def fmix32(x):
    """murmur3's 32-bit finalizer on uint32 (the multiplies wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = tl.mul(x, _FMIX_M1, sanitize_overflow=False)
    x = x ^ (x >> 13)
    x = tl.mul(x, _FMIX_M2, sanitize_overflow=False)
    x = x ^ (x >> 16)
    return x


@triton.jit
def mask_keys(seed_ptr, seed_salt, ACTIVE: tl.constexpr):
    """The uint32 keys ``(k_row, k_col)`` of the 64-bit seed ``load(seed_ptr) + seed_salt`` (int64, wrapping);
    ``(0, 0)``, no load, unless ``ACTIVE``."""
    k_row = 0
    k_col = 0
    if ACTIVE:
        # .to: the interpreter types a host int by its value (int32, uint32 or int64), compiled kernels as int64.
        seed = tl.add(tl.load(seed_ptr), seed_salt.to(tl.int64), sanitize_overflow=False)
        lo = seed.to(tl.uint32)
        hi = (seed >> 32).to(tl.uint32)
        t = fmix32(tl.add(lo, _GOLDEN32, sanitize_overflow=False))
        k_row = fmix32(hi ^ t)
        k_col = fmix32(tl.add(t, k_row, sanitize_overflow=False))
    return k_row, k_col


@triton.jit
def hash_tile(k_row, k_col, rows, cols):
    """uint32 hash of the broadcast tile of global ``rows`` x ``cols`` (a column and a row vector) under the keys."""
    r = fmix32(rows.to(tl.uint32) ^ k_row)
    c = fmix32(cols.to(tl.uint32) ^ k_col)
    return fmix32(tl.add(r, c, sanitize_overflow=False))


@triton.jit
def drop_tile(t, k_row, k_col, p, rows, first_col, ODD: tl.constexpr):
    """``t [BM, BN]`` with its dropped elements zeroed; element ``(i, j)`` is at global row ``rows[i]`` and column
    ``first_col + j``; ``ODD``: ``first_col`` is odd."""
    BM: tl.constexpr = t.shape[0]
    BN: tl.constexpr = t.shape[1]
    threshold = tl.math.ceil(p * 65536.0).to(tl.uint32) << 16
    even, odd = tl.split(tl.reshape(t, (BM, BN // 2, 2)))
    # Column 2w is word w's low half, 2w + 1 its high half; int32 wrap-around is the eager mask's "mod 2**32".
    cols = (first_col + 2 * tl.arange(0, BN // 2)).to(tl.uint32)
    h = hash_tile(k_row, k_col, rows[:, None], (cols >> 1)[None, :])
    if not ODD:
        even = tl.where((h << 16) >= threshold, even, tl.zeros_like(even))
        odd = tl.where(h >= threshold, odd, tl.zeros_like(odd))
    else:
        even = tl.where(h >= threshold, even, tl.zeros_like(even))
        h = hash_tile(k_row, k_col, rows[:, None], ((cols >> 1) + 1)[None, :])
        odd = tl.where((h << 16) >= threshold, odd, tl.zeros_like(odd))
    return tl.reshape(tl.join(even, odd), (BM, BN))
