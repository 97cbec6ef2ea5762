"""The dropout keep-mask as the kernels draw it.

Element ``(m, c)`` of a dropped tensor is kept iff ``u(m, c) >= p`` with (uint32 arithmetic)

    h(m, w) = fmix32(fmix32(m ^ k_row) + fmix32(w ^ k_col)),    u(m, c) = half(h(m, c >> 1), c & 1) * 2**-16

where ``half(h, 0)`` / ``half(h, 1)`` are the low / high 16 bits of ``h``, ``fmix32`` is murmur3's finalizer,
``(k_row, k_col)`` are derived from the 64-bit seed once per program (``mask_keys``, which loads the seed from the
``[1]`` int64 tensor a kernel's ``seed_ptr`` points to: ``parallel_lora._dropout.hash_keys``), and
``c`` is the *global* column (``k_offset + k`` for "pre" on ``x [M, K]``, ``j`` in ``[0, r)`` for "post" on
``x A^T [M, r]``). This is ``parallel_lora._dropout.hash_uniform`` (the eager path), bit for bit. Masks are never
stored: each kernel that needs one regenerates its tile from the seed (``drop_tile``).

Cost: the row term is hashed once per row of the ``[BM, 1]`` vector and the word term once per word of the
``[1, BN / 2]`` vector; per word of the ``[BM, BN / 2]`` tile only the add and the outer fmix32 run (9 integer
ops: add; 3 shifts, 3 xors, 2 multiplies), and per element a shift for the low half and one unsigned compare
against a per-program threshold, against ~130 ops for a Philox-4x32-10 draw per element. Two 16-bit uniforms per
hash, rather than one 24-bit uniform, halve the per-element hashing, the bulk of a masked tile's instructions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._dropout import FMIX_M1, FMIX_M2, GOLDEN32

_FMIX_M1 = tl.constexpr(FMIX_M1)
_FMIX_M2 = tl.constexpr(FMIX_M2)
_GOLDEN32 = tl.constexpr(GOLDEN32)


@triton.jit
def fmix32(x):
    """murmur3's 32-bit finalizer on uint32 (``>>`` is a logical shift on unsigned types; the multiplies
    wrap mod 2**32, hence ``sanitize_overflow=False``)."""
    x = x ^ (x >> 16)
    x = tl.mul(x, _FMIX_M1, sanitize_overflow=False)
    x = x ^ (x >> 13)
    x = tl.mul(x, _FMIX_M2, sanitize_overflow=False)
    x = x ^ (x >> 16)
    return x


@triton.jit
def mask_keys(seed_ptr, ACTIVE: tl.constexpr):
    """The call's keys ``(k_row, k_col)`` (uint32 scalars) from its seed, an int64 at ``seed_ptr`` read once per
    program, so a captured CUDA graph reads each replay's seed (parallel_lora._dropout.hash_keys: every seed bit
    reaches both keys); ``(0, 0)`` and no load when no mask is ``ACTIVE`` (then ``seed_ptr`` may point anywhere)."""
    k_row = 0
    k_col = 0
    if ACTIVE:
        seed = tl.load(seed_ptr)
        lo = seed.to(tl.uint32)  # the low word (an integer narrowing truncates)
        hi = (seed >> 32).to(tl.uint32)
        t = fmix32(tl.add(lo, _GOLDEN32, sanitize_overflow=False))
        k_row = fmix32(hi ^ t)
        k_col = fmix32(tl.add(t, k_row, sanitize_overflow=False))
    return k_row, k_col


@triton.jit
def hash_tile(k_row, k_col, rows, cols):
    """uint32 hash of the broadcast tile of ``rows`` (global row indices) x ``cols`` (global column indices) under
    the call's keys (``mask_keys``); see the module docstring. One operand is normally a column vector and the
    other a row vector, so the two inner hashes run once per row / column and only the add and the outer fmix32 run
    per element."""
    # Indices are non-negative; .to(uint32) is a bitcast for int32 and keeps the low word of an int64.
    r = fmix32(rows.to(tl.uint32) ^ k_row)
    c = fmix32(cols.to(tl.uint32) ^ k_col)
    return fmix32(tl.add(r, c, sanitize_overflow=False))


@triton.jit
def drop_tile(t, k_row, k_col, p, rows, first_col, ODD: tl.constexpr):
    """``t [BM, BN]`` with its dropped elements zeroed: element ``(i, j)`` is row ``rows[i]`` (global, ``[BM]``)
    and global column ``first_col + j``, kept iff ``u >= p`` under the call's keys (``mask_keys``).

    The tile is split into its even and odd columns. With ``first_col`` even (every tile, unless a shard starts
    on an odd column) each pair of columns is one hash word, its low and high half; with ``first_col`` odd
    (``ODD``, given at compile time so that the even case carries no code for it: registers) the pair spans
    two words, at two hashes per pair. The keep test runs in integers, ``v >= ceil(p * 2**16)`` on the 16-bit
    uniform ``v``, the same predicate as ``u >= p`` (both sides exact in fp32); ``p < 1 - 2**-16`` keeps the
    threshold within 16 bits, so the shifted threshold cannot overflow. Split, join and reshape only rename
    registers where the tile keeps column pairs in one thread (the wgmma accumulator does; sm_90a SASS of the
    dx GEMM shows no shared-memory traffic for them)."""
    BM: tl.constexpr = t.shape[0]
    BN: tl.constexpr = t.shape[1]
    threshold = tl.math.ceil(p * 65536.0).to(tl.uint32) << 16
    even, odd = tl.split(tl.reshape(t, (BM, BN // 2, 2)))
    # The even local columns' global indices (int32 wrap-around is the "mod 2**32" of the eager mask).
    cols = (first_col + 2 * tl.arange(0, BN // 2)).to(tl.uint32)
    h = hash_tile(k_row, k_col, rows[:, None], (cols >> 1)[None, :])
    if not ODD:
        even = tl.where((h << 16) >= threshold, even, tl.zeros_like(even))  # column 2w: the word's low half
        odd = tl.where(h >= threshold, odd, tl.zeros_like(odd))  # column 2w + 1: its high half
    else:
        even = tl.where(h >= threshold, even, tl.zeros_like(even))  # an odd global column: its word's high half
        h = hash_tile(k_row, k_col, rows[:, None], ((cols >> 1) + 1)[None, :])
        odd = tl.where((h << 16) >= threshold, odd, tl.zeros_like(odd))  # the next column: the next word's low
    return tl.reshape(tl.join(even, odd), (BM, BN))
