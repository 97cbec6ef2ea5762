"""PEFT's adapter format: tensor keys, ``adapter_config.json``, and the record ``save_adapter`` adds to the tensors.

Keys are ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``; the
config holds PEFT's ``LoraConfig`` fields. The safetensors header of a file we write also records (under
``__metadata__["parallel_lora"]``) the sha256 of the tensor data and the config fields that set the scale: PEFT
and safetensors pass header metadata through untouched, so PEFT loads the file as its own, without a warning
about unknown config keys.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

PEFT_PREFIX = "base_model.model."


def peft_key(name: str, factor: str) -> str:
    """PEFT's key of one factor: ``base_model.model.<path>.lora_A.weight``; a bare layer (path ``""``) gets its own
    state-dict key under the prefix, ``base_model.model.lora_A.weight``."""
    return PEFT_PREFIX + ".".join(p for p in (name, factor, "weight") if p)


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


# The config fields that set what the tensors compute; the tensors file records them, so a config from another
# save (same shapes, another alpha) is refused instead of loading at the wrong scale.
SCALE_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")
RECORD = "parallel_lora"  # the safetensors header metadata key of that record and the tensors' checksum


def _data_section(blob: bytes) -> memoryview:
    """The tensor bytes of a serialized safetensors file (after its 8-byte length and JSON header)."""
    return memoryview(blob)[8 + int.from_bytes(blob[:8], "little"):]


def serialize(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> bytes:
    """The safetensors file of ``tensors``, its header recording the sha256 of the tensor data and ``config``'s
    scale fields. PEFT and safetensors pass header metadata through untouched."""
    from safetensors.torch import save

    data = bytes(_data_section(save(tensors, metadata={"format": "pt"})))
    record = {"tensors_sha256": hashlib.sha256(data).hexdigest(), "config": {k: config[k] for k in SCALE_FIELDS}}
    blob = save(tensors, metadata={"format": "pt", RECORD: json.dumps(record)})
    if _data_section(blob) != data:  # the layout depends on the tensors only, never on the metadata
        raise RuntimeError("save_adapter: safetensors laid the same tensors out differently twice")
    return blob


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


def check_plain_lora(file_config: dict[str, Any], config_path: Path) -> None:
    """Refuse a PEFT config that turns on what ``LoRALinear`` does not compute (DoRA, aLoRA, a LoRA bias...)."""
    found = {k: file_config[k] for k, plain in _PEFT_PLAIN.items() if file_config.get(k) and file_config[k] != plain}
    if found:
        raise ValueError(
            f"load_adapter: {config_path} uses PEFT features parallel_lora does not implement: {found} "
            f"(plain LoRA needs {({k: _PEFT_PLAIN[k] for k in found})})"
        )


def peft_rank_alpha(file_config: dict[str, Any], name: str) -> tuple[Any, Any, str]:
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


def read_record(metadata: dict[str, str], blob: bytes, weights_path: Path) -> dict[str, Any] | None:
    """Verify the sha256 of the tensor data that ``save_adapter`` recorded in the tensors file's header, and return
    the config fields recorded beside it; ``None`` for a file without the record (PEFT's), which is not checked."""
    if RECORD not in metadata:
        return None
    try:
        record = json.loads(metadata[RECORD])
        want, saved = record["tensors_sha256"], record["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"load_adapter: {weights_path} has an unreadable '{RECORD}' record (corrupt?): {e}") from e
    got = hashlib.sha256(_data_section(blob)).hexdigest()
    if got != want:
        raise ValueError(
            f"load_adapter: {weights_path} fails its checksum (sha256 of the tensor data {got[:16]}..., recorded "
            f"{want[:16]}...): the file is corrupt; copy or save it again"
        )
    return saved


def check_saved_with(saved: dict[str, Any], file_config: dict, names: list[str], config_path: Path) -> None:
    """Refuse ``file_config`` unless it gives each module in ``names`` the ``r`` / ``lora_alpha`` / ``use_rslora``
    of ``saved``, the config the tensors were written with (edits that change no module's scale pass)."""
    for name in names:
        then = (*peft_rank_alpha(saved, name)[:2], bool(saved.get("use_rslora")))
        now = (*peft_rank_alpha(file_config, name)[:2], bool(file_config.get("use_rslora")))
        if then != now:
            raise ValueError(
                f"load_adapter: {config_path} is not the config these tensors were saved with: it gives module "
                f"'{name}' r={now[0]}, lora_alpha={now[1]}, use_rslora={now[2]}; the tensors were saved with "
                f"r={then[0]}, lora_alpha={then[1]}, use_rslora={then[2]} (files of two saves mixed?)"
            )
