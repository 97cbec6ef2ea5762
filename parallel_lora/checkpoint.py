"""Adapter files in Hugging Face PEFT's format, and resumable training-state checkpoints.

Adapter files (``save_adapter`` / ``load_adapter``): a directory with

- ``adapter_model.safetensors``: full (gathered) tensors under PEFT's keys
  ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``;
- ``adapter_config.json``: PEFT's ``LoraConfig`` fields (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ...).

Every file is written to a temporary name in the same directory and renamed into place, so a crash never
leaves a torn file; tensors are written before the config that describes them.

Training state (``save_checkpoint`` / ``load_checkpoint``): ``torch.distributed.checkpoint`` (sharded,
reshardable across TP sizes) of the adapters, the optimizer and the step, plus each rank's RNG states, in
``<dir>/step_<N>``. The directory is written under a ``.tmp`` name and renamed once every rank has
finished, so an interrupted save is never picked up as the latest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .layers import lora_modules

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_FACTORS = ("lora_A", "lora_B")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then fsync and rename over ``path``: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# Path components that wrappers insert without changing what the model computes: torch.compile's
# ``_orig_mod``, activation checkpointing's ``_checkpoint_wrapped_module`` and FSDP1's ``_fsdp_wrapped_module``
# (names torch reserves), and ``module`` when the parent is DDP or DataParallel.
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _unwrapped_name(model: nn.Module, name: str) -> str:
    """``name`` as the unwrapped model spells it, the path PEFT's keys use."""
    kept, module = [], model
    for part in name.split("."):
        ddp = isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        if not (part in _WRAPPER_PARTS or (part == "module" and ddp)):
            kept.append(part)
        module = getattr(module, part)
    return ".".join(kept)


def _adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every LoRA layer of ``model`` by its unwrapped name (adapter files are keyed by the model's own paths,
    whatever compile, checkpoint or DDP wrappers the training run put around its parts)."""
    modules = [(_unwrapped_name(model, name), m) for name, m in lora_modules(model)]
    if not modules:
        raise ValueError("the model has no LoRA layers (run apply_lora or build it from parallel_lora layers)")
    return modules


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def peft_config(modules: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """The ``adapter_config.json`` contents PEFT writes for these adapters (``_adapter_modules`` of a model).

    Layers may differ in ``r`` and ``alpha`` (``apply_lora`` called with several configs): the most common pair
    is the file's ``r`` / ``lora_alpha``, and every other layer gets a ``rank_pattern`` / ``alpha_pattern``
    entry keyed by its whole path (escaped, since PEFT reads keys as regular expressions). PEFT has no
    per-module dropout or rsLoRA, so those must agree across layers."""
    shared = {(m.config.dropout, m.config.use_rslora) for _, m in modules}
    if len(shared) != 1:
        raise ValueError(
            "save_adapter: PEFT's format has one lora_dropout and use_rslora for all layers; the model's layers "
            f"have (dropout, use_rslora) in {sorted(shared)}"
        )
    (dropout, use_rslora), = shared
    (r, alpha), _ = Counter((m.config.r, m.config.alpha) for _, m in modules).most_common(1)[0]
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "revision": None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _ in modules}),
        "exclude_modules": None,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {re.escape(name): m.config.r for name, m in modules if m.config.r != r},
        "alpha_pattern": {re.escape(name): m.config.alpha for name, m in modules if m.config.alpha != alpha},
    }


def save_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the adapters of ``model`` (single-device or tensor-parallel) to the directory ``path``.

    Collective under TP: every rank must call it (each gathers its shards); rank 0 writes.
    """
    from safetensors.torch import save_file

    modules = _adapter_modules(model)
    config = peft_config(modules)
    tensors = {}
    for name, m in modules:
        for factor in _FACTORS:
            full = _full(getattr(m, factor).weight.detach())
            tensors[f"{_PEFT_PREFIX}{name}.{factor}.weight"] = full.cpu().contiguous()
    if _rank() == 0:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write(out / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        _atomic_write(out / ADAPTER_CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    _barrier()


# PEFT ``LoraConfig`` fields that make an adapter compute something other than ``s * B A x`` on a plain linear
# layer (LoRA variants, extra trained tensors, other modules), with the value that leaves the math alone.
_PEFT_PLAIN = {
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
    "modules_to_save": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "kasa_config": None,
    "monteclora_config": None,
    "arrow_config": None,
}


def _check_plain_lora(file_config: dict[str, Any], config_path: Path) -> None:
    """Refuse a PEFT config that turns on what ``LoRALinear`` does not compute (DoRA, aLoRA, a LoRA bias...)."""
    found = {k: file_config[k] for k, plain in _PEFT_PLAIN.items() if file_config.get(k) and file_config[k] != plain}
    if found:
        raise ValueError(
            f"load_adapter: {config_path} uses PEFT features parallel_lora does not implement: {found} "
            f"(plain LoRA needs {({k: _PEFT_PLAIN[k] for k in found})})"
        )


def _peft_rank_alpha(file_config: dict[str, Any], name: str) -> tuple[Any, Any, str]:
    """``(r, lora_alpha, where from)`` that PEFT gives module ``name``: the file's ``r`` / ``lora_alpha``, unless a
    ``rank_pattern`` / ``alpha_pattern`` key matches the end of its path (the first that does, as PEFT's
    ``get_pattern_key``)."""
    r, alpha, source = file_config.get("r"), file_config.get("lora_alpha"), ""
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = file_config.get(field) or {}
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", name)), None)
        if key is not None:
            r, alpha = (pattern[key], alpha) if field == "rank_pattern" else (r, pattern[key])
            source += f" ({field}[{key!r}])"
    return r, alpha, source


def load_adapter(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load adapters saved by ``save_adapter`` or by PEFT into ``model``, at any TP size.

    Checks ``r``, ``lora_alpha``, the key set and every shape before touching the model: on any mismatch
    or an unreadable/truncated file it raises ``ValueError`` naming the key and shapes, and the model is
    unchanged. Every rank reads the file and keeps its own shard (no communication).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    weights_path, config_path = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    for p in (weights_path, config_path):
        if not p.is_file():
            raise ValueError(f"load_adapter: {p} does not exist")
    try:
        file_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"load_adapter: {config_path} is not valid JSON ({e})") from e
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"load_adapter: cannot read {weights_path} (truncated or corrupt?): {e}") from e

    modules = _adapter_modules(model)
    if file_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"load_adapter: {config_path} has peft_type={file_config.get('peft_type')!r}, expected 'LORA'")
    _check_plain_lora(file_config, config_path)
    for name, m in modules:
        r, alpha, source = _peft_rank_alpha(file_config, name)
        if r != m.config.r or alpha is None or float(alpha) != float(m.config.alpha):
            raise ValueError(
                f"load_adapter: {config_path} gives module '{name}' r={r}, lora_alpha={alpha}{source}; "
                f"the model's layer has r={m.config.r}, alpha={m.config.alpha}"
            )
        if bool(file_config.get("use_rslora", False)) != m.config.use_rslora:
            raise ValueError(
                f"load_adapter: file has use_rslora={file_config.get('use_rslora')}, module '{name}' has "
                f"{m.config.use_rslora}"
            )

    # PEFT names adapter weights "<path>.lora_A.weight", or "<path>.lora_A.<adapter>.weight" in memory.
    normalized = {re.sub(r"\.(lora_[AB])\.default\.weight$", r".\1.weight", k): v for k, v in tensors.items()}
    plan = []
    expected = set()
    for name, m in modules:
        shapes = {"lora_A": (m.config.r, m.in_features), "lora_B": (m.out_features, m.config.r)}
        for factor in _FACTORS:
            key = f"{_PEFT_PREFIX}{name}.{factor}.weight"
            expected.add(key)
            if key not in normalized:
                raise ValueError(f"load_adapter: {weights_path} has no tensor '{key}' (model module '{name}')")
            t = normalized[key]
            if tuple(t.shape) != shapes[factor]:
                raise ValueError(
                    f"load_adapter: '{key}' has shape {tuple(t.shape)}, the model expects {shapes[factor]}"
                )
            plan.append((getattr(m, factor).weight, t))
    unexpected = sorted(set(normalized) - expected)
    if unexpected:
        raise ValueError(f"load_adapter: {weights_path} has tensors the model lacks, e.g. {unexpected[:4]}")

    with torch.no_grad():
        for param, full in plan:
            full = full.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                # Each rank already holds the full tensor: keep its own shard, no communication.
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
    return model


# -- training-state checkpoints ------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete ``step_<N>`` directory under ``root`` (``.tmp`` directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    steps = [(s, p) for s, p in steps if (p / ".complete").is_file()]
    return max(steps)[1] if steps else None


def _trainable_state(model: nn.Module, optimizer: torch.optim.Optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict | None = None
) -> Path:
    """Save adapters + optimizer + step (+ ``extra``, JSON-able) to ``root/step_<step>``; collective.

    Written to ``step_<step>.tmp`` first, marked complete, and renamed by rank 0 after a barrier.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final, tmp = root / f"step_{step:08d}", root / f"step_{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = _trainable_state(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "extra": extra or {}}
        (tmp / "meta.json").write_text(json.dumps(meta))
        (tmp / ".complete").write_text("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit point: a step_<N> directory is always complete
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore a ``save_checkpoint`` directory (resharding to the current TP layout); returns its metadata
    ``{"step": ..., "extra": ...}``. RNG states are restored when this rank saved one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    if not (path / ".complete").is_file():
        raise ValueError(f"load_checkpoint: {path} is not a complete checkpoint (no .complete marker)")
    model_state, optim_state = _trainable_state(model, optimizer)
    # A checkpoint of single-device LoRALinears has no dropout stream for the parallel layers: they keep theirs.
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_state = {k: v for k, v in model_state.items() if not k.endswith("_extra_state") or f"model.{k}" in saved}
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "meta.json").read_text())
