"""``parallel_lora::lora_forward`` / ``lora_backward``: ``dispatch.forward`` / ``backward`` as torch custom ops."""

from __future__ import annotations

import torch

from .._dropout import Dropout
from .._library import define

_KERNELS: list = []


def dispatch_module():
    """``parallel_lora.kernels.dispatch``, imported (with Triton) at the first call."""
    if not _KERNELS:
        from . import dispatch

        _KERNELS.append(dispatch)
    return _KERNELS[0]


# The op's one signature: a call's ``Dropout`` travels as (p, seed, position, k_offset), p = 0 without one.
FORWARD = ("(Tensor x, Tensor weight, Tensor? bias, Tensor lora_A, Tensor lora_B, float scale, float p, Tensor? seed, "
           "str position, int k_offset) -> (Tensor, Tensor)")
BACKWARD = ("(Tensor dy, Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, Tensor s_lora, float scale, float p, "
            "Tensor? seed, str position, int k_offset, bool needs_dx, bool needs_dA, bool needs_dB) "
            "-> (Tensor, Tensor, Tensor)")


def _dropout(p: float, seed: torch.Tensor | None, position: str, k_offset: int) -> Dropout | None:
    return None if p == 0.0 else Dropout(p, seed, position, k_offset)


def _no_grad(op: str, *tensors: torch.Tensor | None) -> None:
    """Refuse a call autograd would record: these ops have no autograd formula (their gradients would be lost)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"parallel_lora::{op} has no autograd formula: call it with grad mode off, or call "
            "parallel_lora.lora_linear, whose autograd Function calls it"
        )


def _forward(x, weight, bias, lora_A, lora_B, scale, *dropout) -> tuple[torch.Tensor, torch.Tensor]:
    _no_grad("lora_forward", x, weight, bias, lora_A, lora_B)
    return dispatch_module().forward(x, weight, bias, lora_A, lora_B, scale, _dropout(*dropout))


def _backward(dy, x, weight, lora_A, lora_B, s_lora, scale, *args) -> tuple[torch.Tensor, ...]:
    _no_grad("lora_backward", dy, x, weight, lora_A, lora_B, s_lora)
    grads = dispatch_module().backward(dy, x, weight, lora_A, lora_B, s_lora, scale, _dropout(*args[:4]), *args[4:])
    # A custom op returns tensors: a gradient not asked for comes back empty (the caller makes it None).
    return tuple(dy.new_empty(0) if g is None else g for g in grads)


def _programs(direction: str, args: tuple):
    """The ``Programs`` a call of ``_forward`` / ``_backward`` with ``args`` records into, None while its layout is
    not kept: replay.cpp keeps it for the call's layouts and scalars."""
    dispatch = dispatch_module()
    if direction == "forward":
        return dispatch.kept_programs(dispatch.forward_key, args[:5], args[5], _dropout(*args[6:10]))
    return dispatch.kept_programs(dispatch.backward_key, args[:6], args[6], _dropout(*args[7:11]), *args[11:])


def _forward_fake(x, weight, bias, lora_A, lora_B, *scalars):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], lora_A.shape[0])


def _backward_fake(dy, x, weight, lora_A, lora_B, s_lora, *scalars):
    needs_dx, needs_dA, needs_dB = scalars[5:8]  # after scale, p, seed, position, k_offset
    grad = lora_A.dtype
    outs = ((needs_dx, x.shape, dy.dtype), (needs_dA, lora_A.shape, grad), (needs_dB, lora_B.shape, grad))
    return tuple(dy.new_empty(shape if needed else (0,), dtype=dtype) for needed, shape, dtype in outs)


# No autograd kernel: ``functional.LoRAFunction`` calls them with grad mode off, its backward included.
define("lora_forward", FORWARD, _forward, _forward_fake)
define("lora_backward", BACKWARD, _backward, _backward_fake)
