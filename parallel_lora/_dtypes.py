"""The dtype policy: one function decides the compute dtype, one applies the boundary casts.

Rule (docs/design.md, section 2): the compute dtype is the base layer's output dtype, i.e. the autocast dtype when
autocast is active on ``x``'s device, otherwise the base weight's dtype. Casts happen *outside* the
autograd Function, so autograd routes every gradient back through them and each gradient arrives in its
own tensor's dtype (fp32 master adapters get fp32 grads, a bf16 activation gets a bf16 grad).
"""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the base layer would produce for ``F.linear(x, weight)``.

    Under autocast on ``x``'s device this is the autocast dtype, even when ``x`` itself was promoted to
    fp32 (e.g. by ``torch.square`` inside a ReLU^2 MLP); otherwise it is ``weight.dtype``.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Disable autocast inside the op (its inputs are already in the compute dtype); a no-op context when
    autocast is off, since entering ``torch.autocast`` costs host time at every call."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def cast_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Differentiable cast that is a no-op (no copy, no graph node) when ``t`` already has ``dtype``."""
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)
