"""The torch backend, the oracle of every Triton path and the CPU default: docs/kernels.md's formulas on 2-D views."""

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
             needs_dA=True, needs_dB=True):
    """``dy [M, N]`` and the forward's operands and ``S`` -> ``dx [M, K]``, ``dA [r, K]``, ``dB [N, r]``."""
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
