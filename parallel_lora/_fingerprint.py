"""A fingerprint of a model's base, the same at any TP size and dtype (docs/checkpoints.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

SAMPLES = 16
_TINY = 2.0**-14  # fp16's smallest normal: below it a value loaded in fp16 no longer rounds to the same bf16


def _positions(shape: torch.Size) -> torch.Tensor:
    """``[k, ndim]`` global indices of ``k`` positions spread evenly over the flat tensor."""
    n = shape.numel()
    k = min(SAMPLES, n)
    flat = torch.tensor([(2 * i + 1) * n // (2 * k) for i in range(k)], dtype=torch.long)
    return torch.stack(torch.unravel_index(flat, tuple(shape)), dim=1)


def _local_box(p: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(local shape, global offset)`` of this rank's shard, or None where it is not one box."""
    if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)


def _sampled(p: torch.Tensor, local: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """fp32 samples of ``p`` (``local``: its values, if given; -inf where not held) and the mesh to MAX-reduce over."""
    if p.dim() == 0:
        return (p.to_local() if isinstance(p, DTensor) else p).detach().reshape(1).float().cpu(), None
    idx = _positions(p.shape)
    if not isinstance(p, DTensor):
        values = p if local is None else local
        return values.detach()[tuple(idx.T.to(values.device))].float().cpu(), None
    box = _local_box(p)
    if box is None:  # e.g. FSDP2's strided shards over TP: gather the whole tensor
        return p.detach().full_tensor()[tuple(idx.T.to(p.device))].float().cpu(), None
    values = p.to_local() if local is None else local
    shape, offset = (torch.tensor(v, dtype=torch.long) for v in box)
    rel = idx - offset
    owned = ((rel >= 0) & (rel < shape)).all(dim=1)
    out = torch.full((len(idx),), float("-inf"), device=values.device)
    out[owned.to(values.device)] = values.detach()[tuple(rel[owned].T.to(values.device))].float()
    return out, p.device_mesh


# Kept until the next call: gloo's worker thread freeing a collective's tensor at interpreter shutdown aborts.
_KEPT: list[torch.Tensor] = []


def base_fingerprint(params: list[tuple[str, torch.Tensor, torch.Tensor | None]], model_type: str | None) -> dict:
    """``{"model_type", "tensors", "parameters", "sha256"}`` of ``(name, param, local values or None)`` entries;
    collective where a parameter is a DTensor."""
    samples, pending = {}, {}
    _KEPT.clear()
    for name, p, local in params:
        values, mesh = _sampled(p, local)
        samples[name] = values
        if mesh is not None:
            pending.setdefault(id(mesh), (mesh, []))[1].append(name)
    for mesh, names in pending.values():
        flat = torch.cat([samples[n] for n in names])
        _KEPT.append(flat)
        for dim in range(mesh.ndim):
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for n, chunk in zip(names, flat.cpu().split([len(samples[n]) for n in names]), strict=True):
            samples[n] = chunk
    h = hashlib.sha256()
    total = 0
    for name, p, _ in sorted(params, key=lambda e: e[0]):
        total += p.numel()
        h.update(json.dumps([name, list(p.shape)]).encode())
        rounded = samples[name].to(torch.bfloat16)
        rounded = torch.where(rounded.abs() < _TINY, torch.zeros_like(rounded), rounded)
        h.update(rounded.view(torch.int16).numpy().tobytes())
    return {"model_type": model_type, "tensors": len(params), "parameters": total, "sha256": h.hexdigest()}


def describe(fingerprint: dict) -> str:
    """``llama with 1,234,567 parameters in 42 tensors``: a fingerprint in words."""
    kind = fingerprint.get("model_type") or "a model"
    return f"{kind} with {fingerprint.get('parameters', 0):,} parameters in {fingerprint.get('tensors', 0)} tensors"
