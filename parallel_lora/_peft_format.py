"""PEFT's adapter format: tensor keys, ``adapter_config.json``, and our record in the tensors file's header."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .config import LoRAConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_key(name: str, factor: str) -> str:
    """PEFT's key of one factor, ``base_model.model.<path>.lora_A.weight`` (no ``<path>.`` for a bare layer)."""
    return PEFT_PREFIX + ".".join(p for p in (name, factor, "weight") if p)


def peft_config(modules: list[tuple[str, nn.Module]], base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT writes for ``(name, layer)`` pairs; raises if dropout or rsLoRA differ.

    The most common ``(r, alpha)`` is the file's; the other layers get ``rank_pattern`` / ``alpha_pattern`` entries.
    """
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
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _ in modules if name}),
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


SCALE_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")
RECORD = "parallel_lora"


def _header_end(blob: bytes) -> int:
    """Where a safetensors file's tensor bytes start: after the 8-byte header length and the JSON header."""
    return 8 + int.from_bytes(blob[:8], "little")


def _header(blob: bytes) -> dict[str, Any]:
    return json.loads(bytes(memoryview(blob)[8 : _header_end(blob)]))


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of ``tensors`` in sorted-key order, each as its key, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(json.dumps([key, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def serialize(tensors: dict[str, torch.Tensor], config: dict[str, Any], base: dict[str, Any] | None = None) -> bytes:
    """The safetensors bytes of ``tensors``, recording their sha256, ``config``'s scale fields and ``base``."""
    from safetensors.torch import save

    record = {"sha256": tensors_sha256(tensors), "config": {k: config[k] for k in SCALE_FIELDS}}
    if base is not None:
        record["base"] = base
    return save(tensors, metadata={"format": "pt", RECORD: json.dumps(record)})


# PEFT fields that change what an adapter computes, with the value that leaves plain LoRA.
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


def check_plain_lora(file_config: dict[str, Any], config_path: Path) -> None:
    """Refuse a PEFT config that turns on what ``LoRALinear`` does not compute (DoRA, a LoRA bias, ...)."""
    found = {k: file_config[k] for k, plain in _PEFT_PLAIN.items() if file_config.get(k) and file_config[k] != plain}
    if found:
        raise ValueError(
            f"load_adapter: {config_path} uses PEFT features parallel_lora does not implement: {found} "
            f"(plain LoRA needs {({k: _PEFT_PLAIN[k] for k in found})})"
        )


def peft_rank_alpha(file_config: dict[str, Any], name: str) -> tuple[Any, Any, str]:
    """``(r, lora_alpha, where from)`` that PEFT gives module ``name``, patterns matched as in ``get_pattern_key``."""
    r, alpha, source = file_config.get("r"), file_config.get("lora_alpha"), ""
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = file_config.get(field) or {}
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", name)), None)
        if key is not None:
            r, alpha = (pattern[key], alpha) if field == "rank_pattern" else (r, pattern[key])
            source += f" ({field}[{key!r}])"
    return r, alpha, source


_KEY = re.compile(r"^base_model\.model\.(?:(.*)\.)?lora_A(?:\.default)?\.weight$")


def module_names(keys: Iterable[str]) -> list[str]:
    """The module paths an adapter file's ``lora_A`` keys name, in order (``""`` for a bare layer)."""
    return [m.group(1) or "" for k in keys if (m := _KEY.match(k))]


def lora_configs(file_config: dict[str, Any], names: list[str], config_path: Path, **fields: Any) -> list[LoRAConfig]:
    """One ``LoRAConfig`` per distinct ``(r, lora_alpha)`` that ``file_config`` gives the modules ``names``."""
    groups: dict[tuple[Any, Any], list[str]] = {}
    for name in names:
        r, alpha, source = peft_rank_alpha(file_config, name)
        if r is None or alpha is None:
            raise ValueError(f"{config_path} gives module '{name}' r={r}, lora_alpha={alpha}{source}: both are needed")
        groups.setdefault((r, alpha), []).append(name)
    shared = {"use_rslora": bool(file_config.get("use_rslora", False)),
              "dropout": file_config.get("lora_dropout") or 0.0, **fields}
    try:
        return [LoRAConfig(r=r, alpha=alpha, target_modules=tuple(modules), **shared)
                for (r, alpha), modules in groups.items()]
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from e


def read_record(blob: bytes, tensors: dict[str, torch.Tensor], weights_path: Path) -> dict[str, Any] | None:
    """Verify the tensors' recorded sha256 and return the record (``"config"``, maybe ``"base"``), or None (PEFT's)."""
    try:
        metadata = _header(blob).get("__metadata__") or {}
    except ValueError as e:
        raise ValueError(f"load_adapter: cannot read the header of {weights_path} (corrupt?): {e}") from e
    if RECORD not in metadata:
        return None
    try:
        record = json.loads(metadata[RECORD])
        want = record["sha256"]
        if not isinstance(record["config"], dict) or not isinstance(record.get("base", {}), dict):
            raise TypeError("config or base is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"load_adapter: {weights_path} has an unreadable '{RECORD}' record (corrupt?): {e}") from e
    got = tensors_sha256(tensors)
    if got != want:
        raise ValueError(
            f"load_adapter: {weights_path} fails its checksum (sha256 of the tensor data {got[:16]}..., recorded "
            f"{want[:16]}...): the file is corrupt; copy or save it again"
        )
    return record


def check_saved_with(saved: dict[str, Any], file_config: dict, names: list[str], config_path: Path) -> None:
    """Refuse ``file_config`` unless it gives every module the scale fields of ``saved``, the tensors' own config."""
    for name in names:
        then = (*peft_rank_alpha(saved, name)[:2], bool(saved.get("use_rslora")))
        now = (*peft_rank_alpha(file_config, name)[:2], bool(file_config.get("use_rslora")))
        if then != now:
            raise ValueError(
                f"load_adapter: {config_path} is not the config these tensors were saved with: it gives module "
                f"'{name}' r={now[0]}, lora_alpha={now[1]}, use_rslora={now[2]}; the tensors were saved with "
                f"r={then[0]}, lora_alpha={then[1]}, use_rslora={then[2]} (files of two saves mixed?)"
            )


def adapter_files(path: str | os.PathLike, what: str) -> tuple[Path, Path]:
    """``(tensors file, config file)`` of the adapter directory ``path``; ``ValueError`` where one is missing."""
    folder = Path(path)
    weights_path, config_path = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    for p in (weights_path, config_path):
        if not p.is_file():
            left = sorted(folder.parent.glob(f".{folder.name}.old-*")) if not folder.exists() else []
            note = f" (an interrupted save_adapter left the previous adapter at {left[-1]})" if left else ""
            raise ValueError(f"{what}: {p} does not exist{note}")
    return weights_path, config_path


def read_adapter_config(config_path: Path, what: str) -> dict[str, Any]:
    """The JSON of a PEFT ``adapter_config.json``, refused (``ValueError``) unless it is plain LoRA."""
    try:
        file_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {config_path} is not valid JSON ({e})") from e
    if not isinstance(file_config, dict):
        raise ValueError(f"{what}: {config_path} holds no JSON object")
    if file_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{what}: {config_path} has peft_type={file_config.get('peft_type')!r}, expected 'LORA'")
    check_plain_lora(file_config, config_path)
    return file_config


def adapter_configs(path: str | os.PathLike, **fields: Any) -> list[LoRAConfig]:
    """The ``LoRAConfig``s that rebuild the adapter in ``path``: one per distinct ``(r, lora_alpha)``, by full paths.

    Apply each with ``apply_lora`` (``from_pretrained`` takes the list), then ``load_adapter``. ``fields`` set the
    other fields (e.g. ``lora_dtype``). Reads headers only; raises ``ValueError`` naming the file.
    """
    from safetensors import SafetensorError, safe_open

    weights_path, config_path = adapter_files(path, "adapter_configs")
    file_config = read_adapter_config(config_path, "adapter_configs")
    try:
        with safe_open(weights_path, framework="pt") as f:
            names = module_names(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"adapter_configs: cannot read {weights_path} (truncated or corrupt?): {e}") from e
    if not names:
        raise ValueError(f"adapter_configs: {weights_path} holds no LoRA tensors (base_model.model.*.lora_A.weight)")
    try:
        return lora_configs(file_config, names, config_path, **fields)
    except ValueError as e:
        raise ValueError(f"adapter_configs: {e}") from e
