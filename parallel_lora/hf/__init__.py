"""transformers causal LMs with tensor-parallel LoRA, split by their own TP plan (docs/transformers.md)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..config import LoRAConfig
from ..layers import LoRALinear, apply_lora, lora_modules
from ..tp.layers import rank_device
from ._loading import checkpoint_files, init_non_persistent_buffers, load_sharded, plan_load

__all__ = [
    "CheckedCheckpoint",
    "check_checkpoint",
    "check_tp",
    "from_pretrained",
    "model_tp_plan",
    "parallelize",
    "text_config",
]

CONFIG_FILE = "config.json"
# Any one of these makes a tokenizer AutoTokenizer can load (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")

# transformers' plan values -> the torch style with the same layouts (the table in docs/transformers.md).
_TORCH_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
}
# Kept whole: a frozen base has no gradient for transformers' all-reduce to sum.
_REPLICATED = ("replicate", "replicated_with_grad_allreduce")
SUPPORTED_STYLES = (*_TORCH_STYLES, *_REPLICATED)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("parallel_lora.hf needs transformers: pip install 'parallel_lora[hf]'") from e
    return transformers


def text_config(config: Any) -> Any:
    """The language model's part of a transformers ``config`` (a multimodal model's text config), else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _arch(config: Any) -> str:
    return ",".join(getattr(config, "architectures", None) or []) or getattr(config, "model_type", "this model")


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What ``check_checkpoint`` read; ``from_pretrained`` takes it in place of the path and reads neither again."""

    path: Path
    config: Any
    files: dict[str, Path]  # tensor key -> its safetensors file
    tp: int


def check_checkpoint(path: str | Path, tp: int = 1, *, require_tokenizer: bool = True) -> CheckedCheckpoint:
    """Check a local checkpoint directory for loading at TP size ``tp``, reading headers only; ``ValueError`` names
    what is missing or what ``check_tp`` refuses."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise ValueError(f"model path {folder} {what}: expected a Hugging Face checkpoint directory "
                         f"({CONFIG_FILE}, *.safetensors, tokenizer files)")
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{folder} has no {CONFIG_FILE}: not a Hugging Face checkpoint directory")
    if require_tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{folder} has no tokenizer: expected one of {list(TOKENIZER_FILES)} "
                         "(save it there with tokenizer.save_pretrained)")
    files = checkpoint_files(folder)
    try:
        config = _transformers().AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {folder / CONFIG_FILE}: {e}") from e
    check_tp(config, tp)
    return CheckedCheckpoint(folder, config, files, tp)


def check_tp(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless ``config`` declares a plan this module honours and its heads divide by ``tp``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    text = text_config(config)
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{_arch(config)} declares no tensor-parallel plan (config.base_model_tp_plan is empty): "
                         f"it cannot run at tp={tp}; use tp=1")
    check_plan_values(plan)
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(text, field, None)
        if isinstance(value, int) and value % tp != 0:
            raise ValueError(f"{field}={value} is not divisible by the tensor-parallel size tp={tp}: each rank "
                             "must hold whole heads")
    if any(k.endswith("mlp.gate_proj") or k.endswith("mlp.up_proj") for k in plan):
        value = getattr(text, "intermediate_size", None)
        if isinstance(value, int) and value % tp != 0:
            raise ValueError(f"intermediate_size={value} is not divisible by the tensor-parallel size tp={tp}")


def check_plan_values(plan: dict[str, str]) -> None:
    """Refuse, by entry, a plan value this module cannot honour (fused, expert or sequence-parallel styles)."""
    bad = {k: v for k, v in plan.items() if v not in SUPPORTED_STYLES}
    if bad:
        raise ValueError(f"tensor-parallel plan entries parallel_lora cannot honour: {bad}; "
                         f"supported values: {list(SUPPORTED_STYLES)}")


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's whole plan: ``{module path with '*' for layer indices: transformers style name}``."""
    plan = getattr(model, "tp_plan", None)
    if plan is None:  # transformers before the tp_plan property kept the merged plan in _tp_plan
        plan = getattr(model, "_tp_plan", None)
    return dict(plan or {})


def _generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: how plans name a module of every layer."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _resolve(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    """``(module name, style name)`` of every module a plan entry names."""
    return [(name, plan[_generic(name)]) for name, _ in model.named_modules() if name and _generic(name) in plan]


def _split_layer(name: str) -> tuple[str, str]:
    """``model.layers.3.mlp.up_proj`` -> (``model.layers.3``, ``mlp.up_proj``); ``lm_head`` -> (``""``, ``lm_head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1]), ".".join(parts[i + 1 :])
    return "", name


def _check_modules(model: nn.Module, entries: list[tuple[str, str]], tp: int) -> None:
    """Refuse a decoder linear that does not split evenly, or a replicated entry with trainable parameters."""
    for name, value in entries:
        module = model.get_submodule(name)
        if value in _REPLICATED:
            trainable = [n for n, p in module.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(f"'{name}' is '{value}' in the plan but has trainable parameters {trainable}: "
                                 "only a frozen parameter can stay replicated without a gradient all-reduce")
            continue
        if not _split_layer(name)[0] or not isinstance(module, (nn.Linear, LoRALinear)):
            continue  # embeddings and the output head may split unevenly (torch's styles pad)
        dim, size = ("out_features", module.out_features) if "colwise" in value else ("in_features", module.in_features)
        if size % tp != 0:
            raise ValueError(f"'{name}' ({value}) has {dim}={size}, not divisible by the tensor-parallel size tp={tp}")


def _tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(owner path, alias path)`` of each parameter that two modules share (tied input/output embeddings)."""
    seen: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            pairs.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return pairs


def _retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Share again what parallelizing split into two parameters; both sides must have the same layout."""
    for owner, alias in pairs:
        p, q = model.get_parameter(owner), model.get_parameter(alias)
        if p is q:
            continue
        if getattr(p, "placements", None) != getattr(q, "placements", None):
            raise ValueError(f"tied '{owner}' and '{alias}' are split differently by the plan "
                             f"({getattr(p, 'placements', None)} vs {getattr(q, 'placements', None)})")
        module_name, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module_name) if module_name else model, attr, p)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` (after ``apply_lora``, meta or materialized) over the 1-D ``mesh`` by its own plan, in place.

    Raises ``ValueError`` for a missing plan, a value it cannot honour, or a linear that does not divide.
    """
    from ..tp.styles import lora_plan

    tp = mesh.size()
    plan = model_tp_plan(model)
    if not plan:
        if tp > 1:
            raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan: it cannot run at tp={tp}")
        return model
    check_plan_values(plan)
    entries = _resolve(model, plan)
    _check_modules(model, entries, tp)
    groups: dict[str, dict[str, ParallelStyle]] = {}
    for name, value in entries:
        if value in _TORCH_STYLES:
            layer, rest = _split_layer(name)
            groups.setdefault(layer, {})[rest] = _TORCH_STYLES[value]()
    tied = _tied_pairs(model)
    for layer, sub_plan in groups.items():
        parallelize_module(model.get_submodule(layer) if layer else model, mesh, lora_plan(sub_plan))
    _retie(model, tied)
    return model


def _tp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    if mesh is None or mesh.ndim == 1:
        return mesh
    if "tp" not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"a {mesh.ndim}-D mesh needs a dim named 'tp', got names {mesh.mesh_dim_names}")
    return mesh["tp"]


def from_pretrained(
    path: str | Path | CheckedCheckpoint,
    lora_config: LoRAConfig | Sequence[LoRAConfig],
    *,
    mesh: DeviceMesh | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int = 0,
    require_tokenizer: bool = True,
    verbose: bool = False,
) -> nn.Module:
    """A transformers causal LM from checkpoint ``path`` with LoRA adapters, split over ``mesh``, in eval mode.

    Args: ``lora_config`` (one, or a list applied in turn), ``mesh`` (1-D, or with a ``"tp"`` dim; None: one
    device), ``dtype`` (the frozen base's), ``seed`` (A's generator). Each rank reads only its own shards. Raises
    ``ValueError`` before reading any weight for a checkpoint that does not fit.
    """
    transformers = _transformers()
    mesh = _tp_mesh(mesh)
    tp = mesh.size() if mesh is not None else 1
    checked = path if isinstance(path, CheckedCheckpoint) and path.tp == tp else None
    if checked is None:
        folder = path.path if isinstance(path, CheckedCheckpoint) else path
        checked = check_checkpoint(folder, tp, require_tokenizer=require_tokenizer)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(checked.config, dtype=dtype)
    for one in [lora_config] if isinstance(lora_config, LoRAConfig) else lora_config:
        apply_lora(model, one, verbose=verbose)
    if tp > 1:
        parallelize(model, mesh)
    load_plan = plan_load(model, checked.files)  # every key and shape checked, still nothing read

    if device is None:
        device = rank_device(mesh) if mesh is not None else torch.device("cpu")
    device = torch.device(device)
    tied = _tied_pairs(model)
    model.to_empty(device=device)
    _retie(model, tied)
    init_non_persistent_buffers(model)
    model.load_report = load_sharded(model, load_plan)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _, layer in lora_modules(model):
        layer.reset_lora_parameters(generator)
    return model.eval()
