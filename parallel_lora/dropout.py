"""Counter-based dropout for the LoRA branch: the mask is a pure function of (seed, row, column).

Nothing is stored between forward and backward: both passes regenerate the keep-mask from the seed.
Element ``(m, k)`` of the mask (global row ``m``, global column ``k``) is kept when
``uniform(philox(seed, c0=k, c1=m)) >= p``. The eager path below and the Triton kernels compute the
same Philox-4x32-10 stream, so the two backends drop exactly the same elements, and a tensor-parallel shard
that owns columns ``[k_offset, k_offset + K_local)`` sees the matching slice of the full mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Philox-4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Dropout:
    """Dropout on the LoRA branch of one call.

    ``position="pre"`` drops elements of ``x [M, K]`` before ``A``; ``"post"`` drops elements of
    ``x A^T [M, r]`` before ``B``. ``k_offset`` is the global index of this shard's first input column
    (row-parallel layers shard ``K``); it only matters for ``"pre"``.
    """

    p: float
    seed: int
    position: str = "pre"
    k_offset: int = 0

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)


def _umulhi(a: torch.Tensor, b: int) -> torch.Tensor:
    return ((a * b) >> 32) & _MASK32


def philox_uniform(seed: int, c0: torch.Tensor, c1: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from Philox-4x32-10 with counter ``(c0, c1, 0, 0)`` and key ``seed``.

    ``c0``/``c1`` are int64 tensors holding uint32 values; returns fp32. Bit-exact with the Triton kernels'
    ``tl.randint``-based draw followed by the same int->float map.
    """
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0 = c0 & _MASK32
    c1 = c1 & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(_PHILOX_ROUNDS):
        prev_c0, prev_c2 = c0, c2
        c0 = _umulhi(prev_c2, _PHILOX_ROUND_B) ^ c1 ^ k0
        c2 = _umulhi(prev_c0, _PHILOX_ROUND_A) ^ c3 ^ k1
        c1 = (prev_c2 * _PHILOX_ROUND_B) & _MASK32
        c3 = (prev_c0 * _PHILOX_ROUND_A) & _MASK32
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    # Same map as Triton's uint_to_uniform_float for 32-bit ints: reinterpret as int32, fold negatives.
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * 4.6566127342e-10


def keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """Boolean keep-mask ``[rows, cols]`` for this call's dropped tensor (``x`` for "pre", ``x A^T`` for
    "post"), columns shifted by ``k_offset`` for "pre"."""
    offset = dropout.k_offset if dropout.position == "pre" else 0
    m = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    k = torch.arange(offset, offset + cols, device=device, dtype=torch.int64).unsqueeze(0)
    m, k = torch.broadcast_tensors(m, k)
    return philox_uniform(dropout.seed, k, m) >= dropout.p


def new_seed() -> int:
    """A fresh 63-bit seed from the CPU default generator (no device sync, reproducible under
    ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
