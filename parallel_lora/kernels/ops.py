"""The fused LoRA op as torch.compile sees it: ``parallel_lora::lora_forward`` and ``parallel_lora::lora_backward``.

``torch.library.custom_op`` registrations of the Triton path (``parallel_lora.kernels.dispatch``), with fake
implementations giving their outputs' shapes and dtypes, so Dynamo traces ``LoRAFunction`` whole and
Inductor schedules the op as one opaque call. The op's arguments are plain tensors and scalars: a call's
``Dropout`` travels as ``(p, seed, position, k_offset)``, with ``seed`` a ``[1]`` int64 tensor (None without an
active mask). Their real implementations launch the kernels exactly as an eager call does (each layout's tuned
configs, its bound kernels), so there is one launch path, compiled or not.

``compiled_forward`` / ``compiled_backward`` are what the autograd Function calls while compiling; eager calls go to
``dispatch`` directly (a custom op's dispatch costs host time the eager path does not spend).

    lora_forward   x [M, K], W [N, K], b [N] | None, A [r, K], B [N, r]  ->  y [M, N], S [M, r]
    lora_backward  dy [M, N], x, W, A, B, S  ->  dx [M, K], dA [r, K], dB [N, r]   (a gradient not asked for: [0])

All operands in one dtype (the caller casts, ``parallel_lora._dtypes``); outputs in that dtype.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from .._dropout import Dropout, seed_tensor

_KERNELS: list = []  # the dispatch module, imported (with Triton) at the first fused call


def dispatch_module():
    """``parallel_lora.kernels.dispatch``, imported (with Triton) at the first call."""
    if not _KERNELS:
        from . import dispatch

        _KERNELS.append(dispatch)
    return _KERNELS[0]


def _dropout(p: float, seed: torch.Tensor | None, position: str, k_offset: int) -> Dropout | None:
    return None if seed is None else Dropout(p=p, seed=seed, position=position, k_offset=k_offset)


def _unpack(dropout: Dropout | None, device: torch.device) -> tuple[float, torch.Tensor | None, str, int]:
    if dropout is None:
        return 0.0, None, "pre", 0
    seed = dropout.seed if isinstance(dropout.seed, torch.Tensor) else seed_tensor(dropout.seed, device)
    return float(dropout.p), seed, dropout.position, int(dropout.k_offset)


@custom_op("parallel_lora::lora_forward", mutates_args=())
def lora_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    dropout_p: float,
    dropout_seed: torch.Tensor | None,
    dropout_position: str,
    k_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    dropout = _dropout(dropout_p, dropout_seed, dropout_position, k_offset)
    return dispatch_module().forward(x, weight, bias, lora_A, lora_B, scale, dropout)


@lora_forward.register_fake
def _(x, weight, bias, lora_A, lora_B, scale, dropout_p, dropout_seed, dropout_position, k_offset):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], lora_A.shape[0])


@custom_op("parallel_lora::lora_backward", mutates_args=())
def lora_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    s_lora: torch.Tensor,
    scale: float,
    dropout_p: float,
    dropout_seed: torch.Tensor | None,
    dropout_position: str,
    k_offset: int,
    needs_dx: bool,
    needs_dA: bool,
    needs_dB: bool,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dropout = _dropout(dropout_p, dropout_seed, dropout_position, k_offset)
    grads = dispatch_module().backward(
        dy, x, weight, lora_A, lora_B, s_lora, scale, dropout, needs_dx=needs_dx, needs_dA=needs_dA, needs_dB=needs_dB,
        grad_dtype=grad_dtype,
    )
    # A custom op returns tensors: a gradient not asked for comes back empty (``compiled_backward`` makes it None).
    return tuple(dy.new_empty(0) if g is None else g for g in grads)


@lora_backward.register_fake
def _(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout_p, dropout_seed, dropout_position, k_offset, needs_dx,
      needs_dA, needs_dB, grad_dtype=None):  # fmt: skip
    grad = grad_dtype or dy.dtype
    outs = ((needs_dx, x.shape, dy.dtype), (needs_dA, lora_A.shape, grad), (needs_dB, lora_B.shape, grad))
    return tuple(dy.new_empty(shape if needed else (0,), dtype=dtype) for needed, shape, dtype in outs)


def compiled_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    dropout: Dropout | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dispatch.forward`` as the registered op ``parallel_lora::lora_forward``, for a graph being compiled."""
    return torch.ops.parallel_lora.lora_forward(x, weight, bias, lora_A, lora_B, scale, *_unpack(dropout, x.device))


def compiled_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    s_lora: torch.Tensor,
    scale: float,
    dropout: Dropout | None,
    needs_dx: bool = True,
    needs_dA: bool = True,
    needs_dB: bool = True,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dispatch.backward`` as the registered op ``parallel_lora::lora_backward``, for a graph being compiled."""
    grads = torch.ops.parallel_lora.lora_backward(
        dy, x, weight, lora_A, lora_B, s_lora, scale, *_unpack(dropout, x.device), needs_dx, needs_dA, needs_dB,
        grad_dtype,
    )
    return tuple(g if needed else None for g, needed in zip(grads, (needs_dx, needs_dA, needs_dB), strict=True))
