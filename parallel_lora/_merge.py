"""Merging adapters into the base weight, shard by shard, and base-only forwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from .layers import local_tensor, lora_modules


def _merge_factors(name: str, m: nn.Module, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` as local tensors whose product lines up with ``w``, this rank's shard of W (under FSDP2, A is
    gathered over the data-parallel dims)."""
    a, b = m.lora_A.weight, local_tensor(m.lora_B.weight)
    if isinstance(a, DTensor):
        own = getattr(m, "mesh", None)
        if a.device_mesh is not own:
            tp = own.mesh_dim_names[0] if own is not None and own.mesh_dim_names else None
            names = a.device_mesh.mesh_dim_names or (None,) * a.device_mesh.ndim
            if own is not None and (tp is None or tp not in names):
                raise ValueError(
                    f"merge_lora: '{name}' holds A on a mesh with dims {names}, which does not name its "
                    f"tensor-parallel dim {tp!r}; build the meshes with mesh_dim_names"
                )
            keep = [p if n == tp else Replicate() for n, p in zip(names, a.placements, strict=True)]
            a = a.redistribute(a.device_mesh, keep)
        a = a.to_local()
    if b.shape[0] != w.shape[0] or a.shape[1] != w.shape[1] or b.shape[1] != a.shape[0]:
        raise ValueError(
            f"merge_lora: '{name}': B {tuple(b.shape)} @ A {tuple(a.shape)} does not line up with this rank's "
            f"W shard {tuple(w.shape)}; the parameters are sharded in a layout merge_lora does not know"
        )
    return b, a


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place; ``ValueError`` for a training layer with dropout > 0
    (merging would turn its dropout off)."""
    modules = [(n, m) for n, m in lora_modules(model) if not m.merged]
    for name, m in modules:
        if m.training and m.config.dropout > 0:
            raise ValueError(
                f"merge_lora: '{name}' is in training mode with dropout={m.config.dropout}; a merged layer has no "
                "LoRA dropout. Call model.eval() first (or use dropout=0)."
            )
    for name, m in modules:
        w = local_tensor(m.weight)
        b, a = _merge_factors(name, m, w)
        m._weight_before_merge = w.clone()
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * m.scale
        w.copy_((w.to(torch.float32) + delta).to(w.dtype))
        m.merged = True
    return model


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo ``merge_lora`` exactly, restoring each layer's kept pre-merge weight."""
    for _, m in lora_modules(model):
        if m.merged:
            local_tensor(m.weight).copy_(m._weight_before_merge)
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
