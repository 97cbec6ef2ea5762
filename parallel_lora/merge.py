"""Merging adapters into the base weight, and base-only forwards.

``merge_lora`` folds ``s * B A`` into ``W`` shard by shard (no communication): a column shard updates
``W_i += s B_i A`` and a row shard ``W_i += s B A_i``. The pre-merge local weight is kept, so
``unmerge_lora`` restores it bit for bit rather than subtracting in low precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from .layers import lora_modules


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place; merged layers run the base GEMM alone.

    Raises ``ValueError`` for a layer in training mode with dropout > 0: merging would silently turn its
    dropout off. Already-merged layers are left as they are.
    """
    modules = [(n, m) for n, m in lora_modules(model) if not m.merged]
    for name, m in modules:
        if m.training and m.config.dropout > 0:
            raise ValueError(
                f"merge_lora: '{name}' is in training mode with dropout={m.config.dropout}; a merged layer has no "
                "LoRA dropout. Call model.eval() first (or use dropout=0)."
            )
    for _, m in modules:
        w = _local(m.weight)
        a, b = _local(m.lora_A.weight), _local(m.lora_B.weight)
        m._weight_before_merge = w.clone()
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * m.scale
        w.copy_((w.to(torch.float32) + delta).to(w.dtype))
        m.merged = True
    return model


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo ``merge_lora`` exactly (restores each layer's pre-merge local weight)."""
    for _, m in lora_modules(model):
        if m.merged:
            _local(m.weight).copy_(m._weight_before_merge)
            del m._weight_before_merge
            m.merged = False
    return model


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with every LoRA layer's adapter switched off (base-only forward)."""
    modules = [m for _, m in lora_modules(model)]
    previous = [m.adapter_enabled for m in modules]
    for m in modules:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m, p in zip(modules, previous, strict=True):
            m.adapter_enabled = p
