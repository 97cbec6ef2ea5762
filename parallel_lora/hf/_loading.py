"""Sharded loading of a checkpoint's safetensors: each rank reads only its own slice of each tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """``{tensor key: safetensors file}`` of checkpoint directory ``path``, from headers; ``ValueError`` if none."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(f"{index} names shard files that are not in {folder}: {missing}")
        return {key: folder / name for key, name in weight_map.items()}
    files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        note = f"; found {other[:4]}: convert them to safetensors" if other else ""
        raise ValueError(f"no safetensors weights in {folder} (expected {SINGLE_FILE} or {INDEX_FILE}){note}")
    keys: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys.update({key: f for key in handle.keys()})
    return keys


def local_slices(shape: torch.Size, param: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's ``torch.chunk`` piece of a global tensor of ``shape`` held as ``param``.

    Raises ``ValueError`` for placements other than ``Shard(d)`` and ``Replicate()`` (load before ``fully_shard``).
    """
    bounds = [(0, n) for n in shape]
    if not isinstance(param, DTensor):
        return tuple(slice(lo, hi) for lo, hi in bounds)
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"cannot read a checkpoint slice for placement {placement} (only Shard(d) and Replicate()); "
                "load the weights before fully_shard or other re-sharding"
            )
        dim = placement.dim % len(shape)
        lo, hi = bounds[dim]
        chunk = -(-(hi - lo) // mesh.size(mesh_dim))  # torch.chunk's: the last pieces may be short or empty
        start = min(lo + coordinate[mesh_dim] * chunk, hi)
        bounds[dim] = (start, min(start + chunk, hi))
    return tuple(slice(lo, hi) for lo, hi in bounds)


@dataclass
class LoadReport:
    """What one rank read: its slices' bytes, the whole tensors' bytes, the largest slice, the keys."""

    bytes_read: int = 0
    checkpoint_bytes: int = 0
    max_slice_bytes: int = 0
    keys: list[str] = field(default_factory=list)


def _state_tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Every parameter and persistent buffer once, with all its names (tied weights have several)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buf_name, buf in module._buffers.items():
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                names.setdefault(id(buf), []).append(f"{module_name}.{buf_name}" if module_name else buf_name)
                tensors[id(buf)] = buf
    for key, t in tensors.items():
        yield names[key], t


def plan_load(model: nn.Module, files: dict[str, Path], skip: tuple[str, ...] = ("lora_A.", "lora_B.")) -> list:
    """``[(key, file, name)]`` of every model tensor but ``skip``'s, shapes checked from headers (``ValueError``)."""
    from safetensors import safe_open

    plan, missing, wrong = [], [], []
    shapes: dict[Path, dict[str, list[int]]] = {}
    for names, tensor in _state_tensors(model):
        if any(s in n for n in names for s in skip):
            continue
        key = next((n for n in names if n in files), None)
        if key is None:
            missing.append(names[0])
            continue
        f = files[key]
        if f not in shapes:
            with safe_open(str(f), framework="pt") as handle:
                shapes[f] = {k: handle.get_slice(k).get_shape() for k in handle.keys()}
        if key not in shapes[f]:
            raise ValueError(f"{f} has no tensor '{key}' although the checkpoint's index places it there")
        if tuple(shapes[f][key]) != tuple(tensor.shape):
            wrong.append(f"{key}: checkpoint {tuple(shapes[f][key])}, model {tuple(tensor.shape)}")
        plan.append((key, f, names[0]))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:6]}")
    if wrong:
        raise ValueError(f"checkpoint shapes differ from the model built from its config.json: {wrong[:6]}")
    return plan


def load_sharded(model: nn.Module, plan: list) -> LoadReport:
    """Copy this rank's part of every tensor of ``plan`` into the materialized ``model``, one slice at a time."""
    from safetensors import safe_open

    report = LoadReport()
    handles = {}
    try:
        with torch.no_grad():
            for key, f, name in plan:
                tensor = _get(model, name)
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt", device="cpu")
                view = handles[f].get_slice(key)
                full_shape = torch.Size(view.get_shape())
                index = local_slices(full_shape, tensor)
                piece = view[index] if full_shape else handles[f].get_tensor(key)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if piece.shape != local.shape:
                    raise RuntimeError(f"'{key}': read a slice of shape {tuple(piece.shape)} for a local shard of "
                                       f"shape {tuple(local.shape)} ({getattr(tensor, 'placements', None)})")
                local.copy_(piece)
                nbytes = piece.numel() * piece.element_size()
                report.bytes_read += nbytes
                report.max_slice_bytes = max(report.max_slice_bytes, nbytes)
                report.checkpoint_bytes += full_shape.numel() * piece.element_size()
                report.keys.append(key)
                del piece
    finally:
        handles.clear()
    return report


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)


def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (RoPE's ``inv_freq``) after ``to_empty`` by the model's ``_init_weights``.

    Call it before loading the weights, which ``_init_weights`` may also draw.
    """
    for module in model.modules():
        if any(b in module._non_persistent_buffers_set for b, v in module._buffers.items() if v is not None):
            model._init_weights(module)
