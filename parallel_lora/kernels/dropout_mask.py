"""The dropout keep-mask as the kernels draw it, plus a tiny kernel that materializes it for tests.

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

import torch
import triton
import triton.language as tl

from .._dropout import FMIX_M1, FMIX_M2, GOLDEN32, Dropout, seed_tensor
from .host import cdiv

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
def uniform_tile(k_row, k_col, rows, cols):
    """Uniform fp32 in [0, 1) for the broadcast tile of ``rows`` x ``cols``, one hash per element (for tests:
    the kernels draw two elements per hash through ``drop_tile``): the half ``cols & 1`` of ``h(rows, cols >> 1)``
    times ``2**-16`` (exact)."""
    c = cols.to(tl.uint32)
    h = hash_tile(k_row, k_col, rows, c >> 1)
    return ((h >> ((c & 1) * 16)) & 0xFFFF).to(tl.float32) * 1.52587890625e-05


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


@triton.jit(do_not_specialize=["col_offset"], do_not_specialize_on_alignment=["seed_ptr"])
def _lora_dropout_mask_kernel(
    out_ptr,  # [rows, cols] uint8 keep-mask, or fp32 uniforms when WRITE_UNIFORM
    rows,
    cols,
    stride_om,
    stride_oc,
    p,
    seed_ptr,  # [1] int64, the call's seed
    col_offset,
    WRITE_UNIFORM: tl.constexpr,
    ODD_OFFSET: tl.constexpr,  # col_offset is odd
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_c[None, :] * stride_oc
    in_bounds = (offs_m[:, None] < rows) & (offs_c[None, :] < cols)
    k_row, k_col = mask_keys(seed_ptr, True)
    if WRITE_UNIFORM:
        u = uniform_tile(k_row, k_col, offs_m[:, None], col_offset + offs_c[None, :])
        tl.store(ptrs, u, mask=in_bounds)
    else:  # the kernels' own helper, so tests of this mask cover drop_tile (odd column offsets too)
        keep = drop_tile(tl.full((BLOCK_M, BLOCK_C), 1, tl.uint8), k_row, k_col, p, offs_m,
                         col_offset + tl.program_id(1) * BLOCK_C, ODD_OFFSET)  # fmt: skip
        tl.store(ptrs, keep, mask=in_bounds)


def _draw(seed, p: float, rows: int, cols: int, col_offset: int, device, uniform: bool) -> torch.Tensor:
    out = torch.empty(rows, cols, device=device, dtype=torch.float32 if uniform else torch.uint8)
    if rows == 0 or cols == 0:
        return out
    if not isinstance(seed, torch.Tensor):
        seed = seed_tensor(seed, device)
    grid = (cdiv(rows, 32), cdiv(cols, 32))
    _lora_dropout_mask_kernel[grid](
        out, rows, cols, out.stride(0), out.stride(1), float(p), seed, int(col_offset),
        WRITE_UNIFORM=uniform, ODD_OFFSET=col_offset % 2 == 1, BLOCK_M=32, BLOCK_C=32,
    )  # fmt: skip
    return out


def dropout_keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """The ``[rows, cols]`` boolean keep-mask the kernels apply for ``dropout`` (columns shifted by
    ``k_offset`` for "pre"); equals ``parallel_lora._dropout.keep_mask``. For tests and debugging."""
    if dropout.position not in ("pre", "post"):
        raise ValueError(f"dropout.position must be 'pre' or 'post', got {dropout.position!r}")
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0, got rows={rows}, cols={cols}")
    offset = dropout.k_offset if dropout.position == "pre" else 0
    return _draw(dropout.seed, dropout.p, rows, cols, offset, device, uniform=False).view(torch.bool)


def kernel_uniforms(
    seed: int | torch.Tensor, rows: int, cols: int, col_offset: int, device: torch.device | str
) -> torch.Tensor:
    """The kernels' fp32 uniforms ``u(m, col_offset + c)``, ``[rows, cols]``, for ``seed`` (an int, or a ``[1]``
    int64 tensor on ``device``), to check the eager ``parallel_lora._dropout.hash_uniform`` bit for bit."""
    return _draw(seed, 0.0, rows, cols, col_offset, device, uniform=True)
