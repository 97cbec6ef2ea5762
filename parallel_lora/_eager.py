"""The eager (torch) backend: the reference every Triton path is checked against, and the CPU default.

Per call, on 2-D views (``M`` rows):

    forward   y = x W^T + b + (S B^T).to(y.dtype),   S = s * drop_post(drop_pre(x) A^T)  [M, r]
    backward  G  = s * drop_post(dy B)                                              [M, r]
              dx = dy W + drop_pre(G A)                                             [M, K]
              dA = G^T drop_pre(x)                                                  [r, K]
              dB = dy^T S                                                           [N, r]

Every operand is in the compute dtype (the caller casts, as for the kernels), so this is the fused path's reference
up to rounding order. Saved between passes: ``x`` and ``S``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dropout import Dropout, keep_mask


def _drop(t: torch.Tensor, dropout: Dropout | None, position: str) -> torch.Tensor:
    if dropout is None or dropout.position != position:
        return t
    mask = keep_mask(dropout, t.shape[0], t.shape[1], t.device)
    return t * mask.to(t.dtype) * dropout.keep_scale


def forward(x, weight, bias, lora_A, lora_B, scale: float, dropout: Dropout | None):
    """``x [M, K]``, ``W [N, K]``, ``A [r, K]``, ``B [N, r]`` -> ``(y [M, N] in x.dtype, S [M, r] in A.dtype)``."""
    y = F.linear(x, weight, bias)
    xa = _drop(x.to(lora_A.dtype), dropout, "pre") @ lora_A.t()
    s_lora = _drop(xa, dropout, "post") * scale
    # Out of place: selective activation checkpointing may cache F.linear's output and refuses a mutated one.
    y = y + (s_lora @ lora_B.t().to(s_lora.dtype)).to(y.dtype)
    return y, s_lora


def backward(dy, x, weight, lora_A, lora_B, s_lora, scale: float, dropout: Dropout | None, needs_dx=True,
             needs_dA=True, needs_dB=True):  # fmt: skip
    """``dy [M, N]`` (compute dtype) -> ``dx [M, K]`` (compute dtype), ``dA [r, K]``, ``dB [N, r]`` (adapter
    dtypes). ``S`` is the tensor ``forward`` returned."""
    dy_lora = dy.to(lora_B.dtype)
    dB = dy_lora.t() @ s_lora.to(lora_B.dtype) if needs_dB else None
    dx = dA = None
    if needs_dx or needs_dA:
        g = _drop((dy_lora @ lora_B).to(lora_A.dtype) * scale, dropout, "post")
        if needs_dA:
            dA = g.t() @ _drop(x.to(lora_A.dtype), dropout, "pre")
        if needs_dx:
            dx = dy @ weight
            dx += _drop(g @ lora_A, dropout, "pre").to(dx.dtype)
    return dx, dA, dB
