"""The fp64 dense reference for the LoRA op and the tolerance table every numeric test uses.

Reference: ``y = x W^T + b + s * (drop(x) A^T) B^T`` evaluated in float64 by plain autograd from the *same*
tensors the op receives, each already rounded to the dtype the defined compute uses (``x``, ``W``, ``b`` in
the compute dtype; the adapters in their own storage dtype). Its gradients are the fp64 ``dx, dW, db, dA, dB``
of ``<y, dy>``. Nothing in it depends on the library except ``parallel_lora._dropout.keep_mask`` (the mask
definition, which the dropout tests check independently of any backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel_lora._dropout import Dropout, keep_mask

F64 = torch.float64


@dataclass(frozen=True)
class Tol:
    """Bounds on ``|got - ref| <= atol * max|ref| + rtol * |ref|``, elementwise."""

    atol: float
    rtol: float
    why: str


# Keyed on the *compute* dtype (the lowest precision on the path), not on the gradient's storage dtype: an
# fp32 adapter gradient of a bf16 layer is only as good as the bf16 products it is made from. ``atol`` is
# relative to ``max|ref|`` because a dot product's rounding error scales with the size of its terms, not
# with its (possibly cancelling) result.
TOLERANCES: dict[torch.dtype, Tol] = {
    torch.float32: Tol(1e-5, 1e-5, "fp32 operands, fp32 accumulation over K<=48 terms; seen <=3e-7"),
    torch.float16: Tol(
        2e-3, 2e-3, "one rounding of each output (2^-11) plus the rounded S/G/addend: <=4 ulp; seen <=6e-4"
    ),
    torch.bfloat16: Tol(
        1.6e-2,
        1.6e-2,
        "one rounding of each output (2^-8) plus the rounded S/G/addend, and fp32 adapters "
        "cast to bf16 on the fused path: <=4 ulp; seen <=1.1e-2 (triton), <=5.5e-3 (torch)",
    ),
}

# The GPU shapes (K up to 4096): fp32 accumulation adds ~sqrt(K)*2^-24, far below bf16's rounding, and the
# outputs' tails make max|ref| ~5 sigma, so the max-relative atol can be tighter than on the small CPU shapes.
GPU_BF16 = Tol(8e-3, 1.6e-2, "bf16 rounding of each output and of S/G; fp32 accumulation over K<=4096")


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: torch.dtype | Tol, what: str = "") -> None:
    """``got`` (any dtype) against the fp64 ``ref`` under ``TOLERANCES[compute dtype]`` or a given ``Tol``."""
    if isinstance(tol, torch.dtype):
        tol = TOLERANCES[tol]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(
        got.to(F64), ref, atol=tol.atol * max(scale, 1e-30), rtol=tol.rtol, msg=lambda m: f"{what}: {m}"
    )


def mask_for(dropout: Dropout | None, rows: int, cols: int, device) -> torch.Tensor | None:
    """The fp64 ``keep / (1 - p)`` multiplier of the dropped tensor, or ``None``."""
    if dropout is None:
        return None
    return keep_mask(dropout, rows, cols, device).to(F64) * dropout.keep_scale


@dataclass
class Reference:
    y: torch.Tensor
    dx: torch.Tensor | None
    dW: torch.Tensor
    db: torch.Tensor | None
    dA: torch.Tensor
    dB: torch.Tensor


def lora_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    dy: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    dropout: Dropout | None = None,
) -> Reference:
    """fp64 forward (and, given ``dy``, backward) of the LoRA linear.

    ``x``, ``weight`` and ``bias`` are first rounded to ``compute_dtype`` (default: ``weight.dtype``), as the
    op's boundary casts do (e.g. an autocast-promoted fp32 ``x`` is rounded to bf16). Adapters are used at
    their own precision. ``x`` may be ``[*, K]``; dropout masks index its 2-D ``[M, K]`` view.
    """
    cd = compute_dtype or weight.dtype

    def leaf(t, dtype=None):
        if t is None:
            return None
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        return t.to(F64).requires_grad_(True)

    x64, w64, b64 = leaf(x, cd), leaf(weight, cd), leaf(bias, cd)
    a64, bb64 = leaf(lora_A), leaf(lora_B)
    x2d = x64.reshape(-1, x64.shape[-1])
    m, k = x2d.shape
    r = a64.shape[0]
    xd = x2d
    if dropout is not None and dropout.position == "pre":
        xd = x2d * mask_for(dropout, m, k, x.device)
    xa = xd @ a64.t()
    if dropout is not None and dropout.position == "post":
        xa = xa * mask_for(dropout, m, r, x.device)
    y2d = x2d @ w64.t() + scale * (xa @ bb64.t())
    if b64 is not None:
        y2d = y2d + b64
    y = y2d.reshape(*x64.shape[:-1], w64.shape[0])
    if dy is None:
        return Reference(y.detach(), None, None, None, None, None)
    y.backward(dy.detach().to(F64))
    return Reference(y.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad, a64.grad, bb64.grad)
