"""Adapter files in Hugging Face PEFT's format, and resumable training-state checkpoints.

Adapter files (``save_adapter`` / ``load_adapter``): a directory with

- ``adapter_model.safetensors``: full (gathered) tensors under PEFT's keys
  ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``;
- ``adapter_config.json``: PEFT's ``LoraConfig`` fields (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ...).

The directory changes as a whole (``parallel_lora._files.replace_directory``): both files are written into a
fresh sibling directory, synced, and swapped into place, so a reader or a crash sees the previous pair or the new
one, never one file of each. The tensors file records in its safetensors header the sha256 of its tensor data,
the config fields that set the adapters' scale and a fingerprint of the base; ``load_adapter`` checks them (a file
without the record, PEFT's, loads unchecked).

Training state (``save_checkpoint`` / ``load_checkpoint``): ``torch.distributed.checkpoint`` (sharded,
reshardable across TP sizes) of the adapters, the optimizer and the step, plus each rank's RNG states and the sha256
of every file, in ``<dir>/step_<N>``. The directory is written under a ``.tmp-<pid>@<host>`` name and renamed once
every rank has finished, so an interrupted save is never picked up as the latest; a load verifies every file first.

Every call that communicates (``save_adapter`` and ``load_checkpoint`` / ``save_checkpoint`` in a process
group) must be made by every rank. When one of its collectives fails or times out (a rank that did not call
it, or died), it raises ``RuntimeError`` saying so rather than a backend's bare timeout.
"""

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
    # Who writes: without a process group this process is the whole world and writes, whatever $RANK says
    # (log.rank reads $RANK for messages, where staying quiet is harmless; here it would save nothing).
    return dist.get_rank() if _distributed() else 0


_COMM_ERROR = re.compile(r"timed out|connection (closed|reset) by peer|broken pipe|gloo|nccl", re.IGNORECASE)


def is_collective_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective that failed or timed out: a process
    group backend's error, or its message (gloo's "Timed out waiting ...", "Connection closed by peer")."""
    while exc is not None:
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _COMM_ERROR.search(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Re-raise a failed or timed-out collective inside as a ``RuntimeError`` that says every rank must call
    ``what``: the usual cause is a call on rank 0 only (Hugging Face's ``save_pretrained`` habit)."""
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


# Path components that wrappers insert without changing what the model computes: torch.compile's
# ``_orig_mod``, activation checkpointing's ``_checkpoint_wrapped_module`` and FSDP1's ``_fsdp_wrapped_module``
# (names torch reserves), and ``module`` when the parent is DDP or DataParallel.
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
    """Every LoRA layer of ``model`` by its unwrapped name (adapter files are keyed by the model's own paths,
    whatever compile, checkpoint or DDP wrappers the training run put around its parts). A bare LoRA layer is
    its own one module, named ``""``."""
    modules = [(_unwrapped_name(model, name), m) for name, m in lora_modules(model)]
    if not modules:
        raise ValueError("the model has no LoRA layers (run apply_lora or build it from parallel_lora layers)")
    return modules


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _inner(model: nn.Module) -> nn.Module:
    """``model`` without the compile / DDP wrappers around it (whose attributes hide the model's ``config``)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    return model


def _base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """``fingerprint.base_fingerprint`` of every parameter of ``model`` but its adapters, merged layers at their
    pre-merge weights. Collective where the base holds DTensors."""
    adapters, before_merge = set(), {}
    for _, m in lora_modules(model):
        adapters.update(id(p) for factor in _FACTORS for p in getattr(m, factor).parameters())
        if m.merged:
            before_merge[id(m.weight)] = m._weight_before_merge
    params = [(_unwrapped_name(model, n), p, before_merge.get(id(p)))
              for n, p in model.named_parameters() if id(p) not in adapters]
    return base_fingerprint(params, getattr(getattr(_inner(model), "config", None), "model_type", None))


def save_adapter(model: nn.Module, path: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Write the adapters of ``model`` to the directory ``path``, replacing it as a whole.

    ``model``: a model with LoRA layers (single-device or tensor-parallel), or one bare LoRA layer (keys
    ``base_model.model.lora_A.weight`` / ``lora_B.weight``). Collective in a process group: every rank must call
    it (each gathers its shards of the full tensors; rank 0 writes, then tells every rank how it went). A failed
    or timed-out collective raises ``RuntimeError`` saying so. ``path`` must not hold files other than an
    adapter's (``ValueError``): the directory is replaced whole. ``base_model_name_or_path`` (default: the model
    config's ``_name_or_path``) goes into ``adapter_config.json``, a fingerprint of the base into the tensors' header.
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


# save_adapter's gathered tensors and outcome flags, kept until the next call: gloo's worker thread may drop the last
# reference to a collective's tensor after wait() returned, and at interpreter shutdown freeing it there aborts.
_SAVED_TENSORS: dict[str, torch.Tensor] = {}
_OUTCOME_FLAGS: dict[torch.device, torch.Tensor] = {}


def _broadcast_outcome(message: str | None) -> str | None:
    """Rank 0's ``message`` (None: success) on every rank: a kept flag tensor, and the text only on a failure."""
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
    """Warn in one line (``strict``: raise ``ValueError``) when ``model``'s base is not the one the adapter at
    ``path`` was trained on."""
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
    """Load adapters saved by ``save_adapter`` or by PEFT into ``model`` (or into one bare LoRA layer), at any TP
    size.

    Checks, before touching the model: that no adapter is merged (``unmerge_lora()`` first), the tensors'
    checksum and that the config is the one saved with them (files ``save_adapter`` wrote), ``r``,
    ``lora_alpha``, the key set and every shape. On any mismatch or an unreadable/truncated file it raises
    ``ValueError`` naming the file, key or shapes, and the model is unchanged. A base other than the one the adapter
    was trained on (its recorded fingerprint) gets a one-line warning, or ``ValueError`` with ``strict=True``. Every
    rank reads the file and keeps its own shard; the fingerprint of DTensor weights takes one small all-reduce.
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
    if record is not None and record.get("base"):  # files saved before adapters recorded their base have none
        _check_base(model, record["base"], file_config.get("base_model_name_or_path"), path, strict)

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
CHECKSUMS = "checksums.json"  # a checkpoint's {"sha256": {file name: hex digest}} of every other file in it
# A save in progress (or killed): ``step_<N>.tmp-<pid>@<host>`` of the rank 0 that publishes it (untagged: older).
_STEP_TMP = re.compile(r"^step_(?P<step>\d+)\.tmp(?:-(?P<tag>\d+@[A-Za-z0-9._-]+))?$")


def remove_stale_checkpoint_temporaries(root: str | os.PathLike, step: int | None = None) -> list[Path]:
    """Remove the ``step_<N>.tmp-*`` directories under ``root`` (of ``step`` only, if given) whose writer is gone;
    returns them."""
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
    """Save adapters + optimizer + step (+ ``extra``, JSON-able) to ``root/step_<step>``.

    Collective in a process group: every rank must call it (a failed or timed-out collective raises
    ``RuntimeError`` saying so). Written to ``step_<step>.tmp-<pid>@<host>`` (rank 0's) first, marked complete, and
    renamed by rank 0 after a barrier; stale temporaries of the step are removed first.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = root / f"step_{step:08d}"
    names = [f"step_{step:08d}.tmp-{writer_tag()}"]
    if _rank() == 0:
        remove_stale_checkpoint_temporaries(root, step)
        shutil.rmtree(root / names[0], ignore_errors=True)  # this process's own earlier attempt, if one failed
        (root / names[0]).mkdir(parents=True)
    if _distributed():  # every rank writes into rank 0's directory, which exists once this returns
        with _collective("save_checkpoint"):
            dist.broadcast_object_list(names, src=0)
    tmp = root / names[0]
    model_state, optim_state = _trainable_state(model, optimizer)
    with _collective("save_checkpoint"):
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    # Each rank hashes the files it wrote (DCP names a rank's shards __<rank>_<n>.distcp); rank 0 also the rest.
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
            if p.name not in sums and p.is_file():  # .metadata, meta.json, and whatever DCP names otherwise
                sums[p.name] = _sha256(p)
        # Written last, then the marker, both before the rename that publishes the directory.
        (tmp / CHECKSUMS).write_text(json.dumps({"sha256": dict(sorted(sums.items()))}, indent=1) + "\n")
        (tmp / ".complete").write_text("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit point: a step_<N> directory is always complete
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
    """The checksums ``path`` records (``None`` for a checkpoint saved before checkpoints recorded them)."""
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
    """Check every file of the checkpoint ``path`` against the sha256 its ``checksums.json`` records; ``ValueError``
    naming the first bad file. Collective in a process group (each rank hashes its share of the files)."""
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
    """The ``meta.json`` of a ``save_checkpoint`` directory (``{"step": ..., "extra": ...}``), checked against its
    recorded checksum (``ValueError`` if it fails). Reads nothing else; no communication."""
    path = Path(path)
    sums = _recorded_checksums(path)
    if sums is not None and (problem := _problem(path, "meta.json", sums.get("meta.json", ""))):
        raise _corrupt(path, problem)
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _corrupt(path, f"{path / 'meta.json'} is unreadable ({e})") from e


def _check_fits(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Refuse, in one paragraph, a checkpoint whose adapters do not fit the model's (another LoRA rank, other
    target modules, another model), before ``dcp.load`` would fail with one error per tensor."""
    problems = []
    # ``_extra_state`` entries are not adapters: older checkpoints hold the tensor-parallel layers' dropout streams
    # there, which the layers no longer keep (their masks follow the RNG states saved per rank).
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
    """Restore a ``save_checkpoint`` directory (resharding to the current TP layout); returns its metadata
    ``{"step": ..., "extra": ...}``.

    RNG states: this rank restores those rank ``rng_from`` saved, by default its own; a rank the saving run did not
    have (a resume on more ranks) restores rank 0's. That keeps the TP ranks' generators in one state, which their
    dropout masks need, where the saving run seeded its TP ranks alike. Where the layout of data-parallel replicas
    changes, pick ``rng_from`` per rank (``launch/train.py`` takes the first rank of the same replica).

    Collective in a process group: every rank must call it (a failed or timed-out collective raises
    ``RuntimeError`` saying so). Before anything is loaded, a file that fails its recorded checksum
    (``verify_checkpoint``), or adapter shapes or names that differ from the model's, raise ``ValueError`` naming
    them; a checkpoint without checksums (an older one) loads with a warning.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    if not (path / ".complete").is_file():
        raise ValueError(f"load_checkpoint: {path} is not a complete checkpoint (no .complete marker)")
    verify_checkpoint(path)  # before anything is read for loading
    meta = checkpoint_meta(path)
    model_state, optim_state = _trainable_state(model, optimizer)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _check_fits(path, saved, model_state)
    # Only what the model holds is read (an older checkpoint's dropout streams stay in the files); a module's extra
    # state the checkpoint lacks keeps the module's own.
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
