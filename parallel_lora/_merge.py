"""Merging adapters into the base weight, and base-only forwards.

``merge_lora`` folds ``s * B A`` into ``W`` shard by shard (no communication): a column shard updates
``W_i += s B_i A`` and a row shard ``W_i += s B A_i``. Under FSDP2 each rank updates its FSDP shard of W
the same way, with A gathered over the data-parallel dims (one all-gather of ``[r, K]`` per layer). The
pre-merge local weight is kept, so ``unmerge_lora`` restores it bit for bit rather than subtracting in low
precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from .layers import local_tensor, lora_modules


def _merge_factors(name: str, m: nn.Module, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` as local tensors whose product lines up with ``w``, this rank's shard of W.

    On the layer's own layout (one device, or its TP shards) they are the local shards. FSDP2 also shards
    every parameter's dim 0 over its data-parallel mesh dims: W's and B's rows (both ``out``) alike, but A's
    rows are r, so A is gathered over those dims and keeps only its tensor-parallel placement.
    """
    a, b = m.lora_A.weight, local_tensor(m.lora_B.weight)
    if isinstance(a, DTensor):
        own = getattr(m, "mesh", None)  # a tensor-parallel layer's 1-D mesh
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
    """Undo ``merge_lora`` exactly (restores each layer's pre-merge local weight)."""
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
