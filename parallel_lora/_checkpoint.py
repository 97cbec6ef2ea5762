"""Adapter files in PEFT's format and resumable training checkpoints (docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._files import is_stale, replace_directory, writer_tag
from ._fingerprint import base_fingerprint, describe
from ._log import logger
from ._peft_format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_files,
    check_saved_with,
    peft_config,
    peft_key,
    peft_rank_alpha,
    read_adapter_config,
    read_record,
    serialize,
)
from .layers import lora_modules

_FACTORS = ("lora_A", "lora_B")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    # Not _log.rank: without a process group this process writes, whatever $RANK says.
    return dist.get_rank() if _distributed() else 0


_COMM_ERROR = re.compile(r"timed out|connection (closed|reset) by peer|broken pipe|gloo|nccl", re.IGNORECASE)


def is_collective_failure(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a collective that failed or timed out."""
    while exc is not None:
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _COMM_ERROR.search(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Re-raise a failed collective inside as a ``RuntimeError`` saying that every rank must call ``what``."""
    try:
        yield
    except Exception as e:
        if not is_collective_failure(e):
            raise
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"{what} is collective: every rank must call it, and a collective inside it failed ({cause}). Call it "
            f"on every rank of the process group, not only on rank 0; if every rank did, another rank died or hangs."
        ) from e


def _barrier(what: str) -> None:
    if _distributed():
        with _collective(what):
            dist.barrier()


_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _unwrapped_name(model: nn.Module, name: str) -> str:
    """``name`` as the unwrapped model spells it, the path PEFT's keys use (``""`` for the model itself)."""
    if not name:
        return ""
    kept, module = [], model
    for part in name.split("."):
        ddp = isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        if not (part in _WRAPPER_PARTS or (part == "module" and ddp)):
            kept.append(part)
        module = getattr(module, part)
    return ".".join(kept)


def _adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every LoRA layer of ``model`` by its unwrapped name (``""`` for a bare layer)."""
    modules = [(_unwrapped_name(model, name), m) for name, m in lora_modules(model)]
    if not modules:
        raise ValueError("the model has no LoRA layers (run apply_lora or build it from parallel_lora layers)")
    return modules


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _inner(model: nn.Module) -> nn.Module:
    """``model`` without the compile / DDP wrappers around it."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    return model


def _base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """``base_fingerprint`` of every parameter but the adapters, merged weights before the merge; collective."""
    adapters, before_merge = set(), {}
    for _, m in lora_modules(model):
        adapters.update(id(p) for factor in _FACTORS for p in getattr(m, factor).parameters())
        if m.merged:
            before_merge[id(m.weight)] = m._weight_before_merge
    params = [(_unwrapped_name(model, n), p, before_merge.get(id(p)))
              for n, p in model.named_parameters() if id(p) not in adapters]
    return base_fingerprint(params, getattr(getattr(_inner(model), "config", None), "model_type", None))


def save_adapter(model: nn.Module, path: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Write the adapters of ``model`` (or of one bare LoRA layer) to the directory ``path`` in PEFT's format.

    Every rank must call it. ``base_model_name_or_path`` defaults to the model config's ``_name_or_path``. Raises
    ``ValueError`` if ``path`` holds other files, ``RuntimeError`` if a collective fails.
    """
    out = Path(path)
    modules = _adapter_modules(model)
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(_inner(model), "config", None), "_name_or_path", None) or None
    config = peft_config(modules, None if base_model_name_or_path is None else str(base_model_name_or_path))
    if out.exists():
        _check_adapter_only(out)
    tensors = _SAVED_TENSORS
    tensors.clear()
    with _collective("save_adapter"):
        for name, m in modules:
            for factor in _FACTORS:
                tensors[peft_key(name, factor)] = _full(getattr(m, factor).weight.detach()).cpu().contiguous()
        base = _base_fingerprint(model)
    error = None
    if _rank() == 0:
        try:
            files = {ADAPTER_WEIGHTS: serialize(tensors, config, base),
                     ADAPTER_CONFIG: (json.dumps(config, indent=2) + "\n").encode()}
            replace_directory(out, files, keep=("README.md",))
        except Exception as e:
            error = e
    if _distributed():
        with _collective("save_adapter"):
            failed = _broadcast_outcome(None if error is None else f"{type(error).__name__}: {error}")
        if failed is not None and error is None:
            raise RuntimeError(f"save_adapter: rank 0 could not write {out}: {failed}")
    if error is not None:
        raise error


# Kept until the next call: gloo's worker thread freeing a collective's tensor at interpreter shutdown aborts.
_SAVED_TENSORS: dict[str, torch.Tensor] = {}
_OUTCOME_FLAGS: dict[torch.device, torch.Tensor] = {}


def _broadcast_outcome(message: str | None) -> str | None:
    """Rank 0's ``message`` (None: success) on every rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = _OUTCOME_FLAGS.setdefault(device, torch.zeros(1, dtype=torch.int32, device=device))
    flag.fill_(0 if message is None else 1)
    dist.broadcast(flag, src=0)
    if not flag.item():
        return None
    text = [message]
    dist.broadcast_object_list(text, src=0)
    return text[0]


def _check_base(model: nn.Module, saved: dict[str, Any], name: str | None, path: str | os.PathLike,
                strict: bool) -> None:
    """Warn (``strict``: raise ``ValueError``) when ``model``'s base is not the one the adapter was trained on."""
    with _collective("load_adapter"):
        now = _base_fingerprint(model)
    if all(now.get(k) == saved.get(k) for k in ("model_type", "tensors", "parameters", "sha256")):
        return
    trained_on = f"{name!r} ({describe(saved)})" if name else describe(saved)
    same_sizes = all(now[k] == saved.get(k) for k in ("model_type", "tensors", "parameters"))
    differs = "has the same sizes but other weights" if same_sizes else f"is {describe(now)}"
    message = f"load_adapter: the adapter {path} was trained on {trained_on}, and this model's base {differs}"
    if strict:
        raise ValueError(f"{message}; load it onto its own base")
    logger.warning(f"warning: {message}: its outputs will not be the trained ones (strict=True refuses)")


def _check_adapter_only(out: Path) -> None:
    if not out.is_dir():
        raise ValueError(f"save_adapter: {out} exists and is not a directory")
    others = sorted(p.name for p in out.iterdir() if p.name not in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md"))
    if others:
        raise ValueError(
            f"save_adapter: {out} holds {others[:5]} besides an adapter; save_adapter replaces the directory as a "
            f"whole, so give the adapter a directory of its own (e.g. {out / 'adapter'})"
        )


def load_adapter(model: nn.Module, path: str | os.PathLike, *, strict: bool = False) -> nn.Module:
    """Load adapters saved by ``save_adapter`` or PEFT into ``model`` (or one bare LoRA layer), at any TP size.

    Raises ``ValueError``, leaving the model unchanged, on any mismatch; another base warns, or raises with ``strict``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    modules = _adapter_modules(model)
    merged = [name or type(m).__name__ for name, m in modules if m.merged]
    if merged:
        raise ValueError(
            f"load_adapter: the model's adapters are merged into its weights ({merged[:4]}); loading would leave "
            "the merged update in effect. unmerge_lora() first, then load (and merge_lora() again if wanted)"
        )
    weights_path, config_path = adapter_files(path, "load_adapter")
    file_config = read_adapter_config(config_path, "load_adapter")
    blob = weights_path.read_bytes()
    try:
        tensors = load(blob)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"load_adapter: cannot read {weights_path} (truncated or corrupt?): {e}") from e
    record = read_record(blob, tensors, weights_path)

    for name, m in modules:
        r, alpha, source = peft_rank_alpha(file_config, name)
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
    if record is not None:
        check_saved_with(record["config"], file_config, [name for name, _ in modules], config_path)

    # PEFT names adapter weights "<path>.lora_A.weight", or "<path>.lora_A.<adapter>.weight" in memory.
    normalized = {re.sub(r"\.(lora_[AB])\.default\.weight$", r".\1.weight", k): v for k, v in tensors.items()}
    plan = []
    expected = set()
    for name, m in modules:
        shapes = {"lora_A": (m.config.r, m.in_features), "lora_B": (m.out_features, m.config.r)}
        for factor in _FACTORS:
            key = peft_key(name, factor)
            expected.add(key)
            if key not in normalized:
                raise ValueError(
                    f"load_adapter: {weights_path} has no tensor '{key}' (model module '{name}'; a bare layer's "
                    "file has the keys base_model.model.lora_A.weight / lora_B.weight, a model's their module paths)"
                )
            t = normalized[key]
            if tuple(t.shape) != shapes[factor]:
                raise ValueError(
                    f"load_adapter: '{key}' has shape {tuple(t.shape)}, the model expects {shapes[factor]}"
                )
            plan.append((getattr(m, factor).weight, t))
    unexpected = sorted(set(normalized) - expected)
    if unexpected:
        raise ValueError(f"load_adapter: {weights_path} has tensors the model lacks, e.g. {unexpected[:4]}")
    if record is not None and record.get("base"):
        _check_base(model, record["base"], file_config.get("base_model_name_or_path"), path, strict)

    with torch.no_grad():
        for param, full in plan:
            full = full.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
    return model


_STEP_DIR = re.compile(r"^step_(\d+)$")
CHECKSUMS = "checksums.json"
_STEP_TMP = re.compile(r"^step_(?P<step>\d+)\.tmp(?:-(?P<tag>\d+@[A-Za-z0-9._-]+))?$")


def remove_stale_checkpoint_temporaries(root: str | os.PathLike, step: int | None = None) -> list[Path]:
    """Remove and return the ``step_<N>.tmp-*`` directories in ``root`` (of ``step``, if given) whose writer is gone."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = _STEP_TMP.match(p.name)
        if m and (step is None or int(m["step"]) == step) and is_stale(p, m["tag"]):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


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
    """Save the adapters, optimizer state, RNG states, ``step`` and ``extra`` (JSON-able) to ``root/step_<step>``.

    Every rank must call it; returns the directory, which appears only once complete.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = root / f"step_{step:08d}"
    names = [f"step_{step:08d}.tmp-{writer_tag()}"]
    if _rank() == 0:
        remove_stale_checkpoint_temporaries(root, step)
        shutil.rmtree(root / names[0], ignore_errors=True)
        (root / names[0]).mkdir(parents=True)
    if _distributed():
        with _collective("save_checkpoint"):
            dist.broadcast_object_list(names, src=0)
    tmp = root / names[0]
    model_state, optim_state = _trainable_state(model, optimizer)
    with _collective("save_checkpoint"):
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    mine = re.compile(rf"^(__{_rank()}_\d+\.distcp|rng_rank{_rank()}\.pt)$")
    sums = {p.name: _sha256(p) for p in tmp.iterdir() if mine.match(p.name)}
    gathered = [sums]
    if _distributed():
        gathered = [None] * dist.get_world_size() if _rank() == 0 else None
        with _collective("save_checkpoint"):
            dist.gather_object(sums, gathered, dst=0)
    if _rank() == 0:
        sums = {name: digest for part in gathered for name, digest in part.items()}
        for p in tmp.iterdir():
            if p.name not in sums and p.is_file():
                sums[p.name] = _sha256(p)
        (tmp / CHECKSUMS).write_text(json.dumps({"sha256": dict(sorted(sums.items()))}, indent=1) + "\n")
        (tmp / ".complete").write_text("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier("save_checkpoint")
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _corrupt(path: Path, problem: str) -> ValueError:
    return ValueError(
        f"load_checkpoint: {problem}: the checkpoint is corrupt, and nothing was loaded. Delete {path} to resume "
        "from the checkpoint before it, or start over"
    )


def _recorded_checksums(path: Path) -> dict[str, str] | None:
    """The checksums ``path`` records, or ``None``."""
    manifest = path / CHECKSUMS
    if not manifest.is_file():
        return None
    try:
        sums = json.loads(manifest.read_text())["sha256"]
        if not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
            raise TypeError("not a mapping of file names to digests")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"{manifest} is unreadable ({e})") from e
    return sums


def _problem(path: Path, name: str, want: str) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    got = _sha256(file)
    return None if got == want else f"{file} fails its checksum (sha256 {got[:16]}..., recorded {want[:16]}...)"


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of checkpoint ``path`` against its ``checksums.json``; ``ValueError`` naming one; collective."""
    path = Path(path)
    sums = _recorded_checksums(path)
    if sums is None:
        logger.warning(f"warning: load_checkpoint: {path} has no {CHECKSUMS} (saved before checkpoints recorded "
                       "checksums), so it loads unverified")
        return
    names = sorted(sums)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    problems = [p for name in names[rank::world] if (p := _problem(path, name, sums[name]))]
    unlisted = sorted(p.name for p in path.iterdir() if p.name not in sums and p.name not in (CHECKSUMS, ".complete"))
    if unlisted:
        problems.append(f"{path / unlisted[0]} is not in its {CHECKSUMS} (added after the save?)")
    if _distributed():
        everyone = [None] * world
        with _collective("load_checkpoint"):
            dist.all_gather_object(everyone, problems)
        problems = [p for part in everyone for p in part]
    if problems:
        raise _corrupt(path, sorted(problems)[0])


def checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``{"step": ..., "extra": ...}`` of a ``save_checkpoint`` directory, checked against its checksum; local."""
    path = Path(path)
    sums = _recorded_checksums(path)
    if sums is not None and (problem := _problem(path, "meta.json", sums.get("meta.json", ""))):
        raise _corrupt(path, problem)
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _corrupt(path, f"{path / 'meta.json'} is unreadable ({e})") from e


def _check_fits(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Refuse in one ``ValueError`` a checkpoint whose adapter names or shapes differ from the model's."""
    problems = []
    # Older checkpoints keep the TP layers' dropout streams in ``_extra_state``: not adapters.
    for key, t in model_state.items():
        if key.endswith("_extra_state"):
            continue
        meta = saved.get(f"model.{key}")
        if meta is None:
            problems.append(f"'{key}' is not in the checkpoint")
        elif hasattr(meta, "size") and tuple(meta.size) != tuple(t.shape):
            problems.append(f"'{key}' is {list(meta.size)} in the checkpoint and {list(t.shape)} in the model")
    lacking = sorted(k[len("model."):] for k in saved if k.startswith("model.") and not k.endswith("_extra_state")
                     and k[len("model."):] not in model_state)
    if lacking:
        problems.append(f"the checkpoint has {len(lacking)} tensors the model lacks, e.g. '{lacking[0]}'")
    if problems:
        raise ValueError(
            f"load_checkpoint: {path} does not fit this model ({len(problems)} mismatches): "
            f"{'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}. It was saved from adapters of "
            "another shape (another LoRA rank, other target modules or another model); nothing was loaded."
        )


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, rng_from: int | None = None
) -> dict[str, Any]:
    """Restore a ``save_checkpoint`` directory at the current TP layout; returns ``{"step": ..., "extra": ...}``.

    Every rank must call it. ``rng_from``: the saved rank whose RNG states to restore (default: this rank, else 0).
    Raises ``ValueError`` before loading anything for a corrupt checkpoint or adapters that do not fit.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    if not (path / ".complete").is_file():
        raise ValueError(f"load_checkpoint: {path} is not a complete checkpoint (no .complete marker)")
    verify_checkpoint(path)
    meta = checkpoint_meta(path)
    model_state, optim_state = _trainable_state(model, optimizer)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _check_fits(path, saved, model_state)
    model_state = {k: v for k, v in model_state.items() if not k.endswith("_extra_state") or f"model.{k}" in saved}
    state = {"model": model_state, "optim": optim_state}
    with _collective("load_checkpoint"):
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    rng_file = path / f"rng_rank{_rank() if rng_from is None else rng_from}.pt"
    if not rng_file.is_file():
        rng_file = path / "rng_rank0.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta
