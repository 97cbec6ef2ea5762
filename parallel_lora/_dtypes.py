"""The dtype rule (docs/design.md, section 2): one function decides the compute dtype."""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of ``F.linear(x, weight)``: the autocast dtype where autocast is on for ``x``'s device, else W's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


NO_CONTEXT = contextlib.nullcontext()  # stateless: one serves every call


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off inside the op; a null context where it is already off (entering autocast costs host time)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return NO_CONTEXT


def cast_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)
