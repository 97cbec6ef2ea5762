"""``LoRALinear``, the base class of every LoRA layer, and ``apply_lora``, the swap of matching ``nn.Linear``s."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch._C import _are_functorch_transforms_active as functorch_active
from torch.distributed.tensor import DTensor, distribute_tensor

from ._dropout import DropoutStream
from ._log import logger
from .config import LoRAConfig
from .functional import Plan, Plans, call_key, linear, lora_apply, make_plan


def init_lora_A_(weight: torch.Tensor, config: LoRAConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Initialise a *global* ``A [r, in]`` in place, so the result never depends on how it is sharded later."""
    r, fan_in = weight.shape
    with torch.no_grad():
        if config.init_A == "kaiming":
            # PEFT's default: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
            bound = 1.0 / math.sqrt(fan_in)
            weight.uniform_(-bound, bound, generator=generator)
        elif config.init_A == "xavier":
            bound = math.sqrt(6.0 / (fan_in + r))
            weight.uniform_(-bound, bound, generator=generator)
        else:  # gaussian
            weight.normal_(0.0, 1.0 / r, generator=generator)
    return weight


def init_base_weight_(weight: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``nn.Linear``'s default init of a *global* ``W [out, in]`` in place: kaiming_uniform_(a=sqrt(5))."""
    with torch.no_grad():
        return nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def fill_global_(param: torch.Tensor, init: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Fill ``param`` in place with ``init`` of its global tensor; a DTensor keeps rank 0's draw (all ranks call)."""
    with torch.no_grad():
        if not isinstance(param, DTensor):
            init(param)
            return
        local = param.to_local()
        full = init(torch.empty(param.shape, dtype=param.dtype, device=local.device))
        local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0).to_local())


class LoRAFactor(nn.Linear):
    """``lora_A`` or ``lora_B``: a bias-free ``nn.Linear`` holding one factor; its owning layer initialises it."""

    def reset_parameters(self) -> None:
        pass


class LoRALayer(nn.Module):
    """Base of every LoRA layer: frozen ``weight``/``bias``, ``lora_A``/``lora_B``, their init, merge state, plans."""

    config: LoRAConfig

    def _init_state(self, dropout_stream: DropoutStream) -> None:
        self.merged = False
        self.adapter_enabled = True
        self._dropout_stream = dropout_stream
        self._plans = Plans()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw W, zero the bias, then ``reset_lora_parameters``: the constructor's values for the same seed.

        For a module built on the meta device, after ``to_empty()``; ``generator`` on the parameters' device."""
        self._check_unmerged("reset_parameters")
        fill_global_(self.weight, lambda w: init_base_weight_(w, generator))
        if self.bias is not None:
            with torch.no_grad():
                local_tensor(self.bias).zero_()  # zeros need no draw, so no rank-0 scatter either
        self.reset_lora_parameters(generator)

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """A from ``config.init_A`` (global shape), B zeros: the update starts at exactly zero."""
        self._check_unmerged("reset_lora_parameters")
        fill_global_(self.lora_A.weight, lambda a: init_lora_A_(a, self.config, generator))
        with torch.no_grad():
            local_tensor(self.lora_B.weight).zero_()

    def _call_plan(self, x: torch.Tensor, key_tensors: tuple, build: Callable[[], Plan], *more) -> Plan:
        """The kept plan of ``x``'s call signature (``key_tensors``: W, bias, A, B as stored; ``more``), else
        ``build()``."""
        if torch.compiler.is_compiling() or isinstance(x, DTensor) or x.is_meta or functorch_active():
            return build()
        config = self.config
        key = call_key(x, *key_tensors, self.training, id(config), *more)
        plan = self._plans.get(key)
        if plan is None:
            plan = build()
            plan.config = config  # a kept plan holds the config its key names by id, so no other config takes the id
            self._plans.keep(key, plan)
        return plan

    def _make_plan(self, x, weight, bias, lora_A, lora_B, k_offset: int = 0, comms: tuple = (None, None)) -> Plan:
        c = self.config
        return make_plan(x, weight, bias, lora_A, lora_B, c.scale, c.backend, c.dropout, self.training,
                         c.dropout_position, k_offset, *comms)

    def _stored(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``(W, bias, A, B)`` as stored; plain parameters are read from the module dicts (``nn.Module.__getattr__``
        costs about a microsecond each), anything else (a parametrization) through ``getattr``."""
        params, modules = self._parameters, self._modules
        try:
            A, B = modules["lora_A"]._parameters["weight"], modules["lora_B"]._parameters["weight"]
            return params["weight"], params["bias"] if "bias" in params else self.bias, A, B
        except KeyError:
            return self.weight, self.bias, self.lora_A.weight, self.lora_B.weight

    def _check_unmerged(self, what: str) -> None:
        if self.merged:
            raise ValueError(f"{type(self).__name__}.{what}: unmerge_lora() first; the merged weight holds the update")

    @property
    def scale(self) -> float:
        return self.config.scale


class LoRALinear(LoRALayer):
    """``y = x W^T + b + s * (drop(x) A^T) B^T`` on one device: ``x [*, in]`` -> ``y [*, out]``, base output dtype.

    Adapters ``lora_A.weight [r, in]``, ``lora_B.weight [out, r]`` (PEFT's names) in ``config.lora_dtype or W's``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: LoRAConfig,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.config = in_features, out_features, config
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **factory), requires_grad=False) if bias else None
        init_base_weight_(self.weight)
        self._add_adapters()

    def _add_adapters(self) -> None:
        w, r = self.weight, self.config.r
        lora_dtype = self.config.lora_dtype or w.dtype
        factory = {"bias": False, "dtype": lora_dtype, "device": w.device}
        self.lora_A = LoRAFactor(self.in_features, r, **factory)
        self.lora_B = LoRAFactor(r, self.out_features, **factory)
        self._init_state(DropoutStream())
        self.reset_lora_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LoRAConfig) -> LoRALinear:
        """Wrap an existing ``nn.Linear``: its weight and bias are shared (not copied) and frozen."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features, module.config = linear.in_features, linear.out_features, config
        module.weight, module.bias = linear.weight, linear.bias
        for p in (module.weight, module.bias):
            if p is not None:
                p.requires_grad_(False)
        module._add_adapters()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, A, B = self._stored()
        if self.merged or not self.adapter_enabled:
            return linear(x, weight, bias)
        plan = self._call_plan(x, (weight, bias, A, B), lambda: self._make_plan(x, weight, bias, A, B))
        seed = self._dropout_stream.next_seed(x) if plan.p else None
        return lora_apply(x, weight, bias, A, B, plan, seed)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"r={c.r}, alpha={c.alpha}, dropout={c.dropout}, merged={self.merged}"
        )


def _matches(name: str, targets: tuple[str, ...] | str) -> bool:
    if targets == "all-linear":
        return name.rsplit(".", 1)[-1] != "lm_head"
    if isinstance(targets, str):
        targets = (targets,)
    # PEFT's rule: the full dotted name or any dotted suffix of it matches; "*" in a glob may span dots
    return any(
        name == t or name.endswith("." + t) or fnmatch.fnmatchcase(name, t) or fnmatch.fnmatchcase(name, "*." + t)
        for t in targets
    )


def iter_target_linears(model: nn.Module, config: LoRAConfig) -> Iterator[tuple[str, nn.Linear]]:
    """``(dotted name, module)`` of every ``nn.Linear`` (subclasses too) that ``config.target_modules`` selects."""
    # PEFT's "all-linear" skips the output projection whatever its name (GPT-NeoX: embed_out), else lm_head
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) and config.target_modules == "all-linear" else None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, LoRAFactor) and name and module is not head:
            if _matches(name, config.target_modules):
                yield name, module


def _skipped_subclass(module: nn.Linear) -> bool:
    """A subclass (quantized, fp8, ``MultiheadAttention.out_proj``) may not compute ``x W^T + b``: left alone."""
    return type(module) is not nn.Linear


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_lora(model: nn.Module, config: LoRAConfig, verbose: bool = True) -> nn.Module:
    """Swap matching ``nn.Linear``s for ``LoRALinear``s in place and freeze all else but earlier adapters.

    Returns the model with ``model.lora_summary``, logged at INFO (DEBUG unless ``verbose``); raises if none match.
    """
    selected = list(iter_target_linears(model, config))
    matched = [(n, m) for n, m in selected if not _skipped_subclass(m)]
    skipped = [f"{n} ({type(m).__name__})" for n, m in selected if _skipped_subclass(m)]
    if not matched:
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear][:8]
        note = f"; matched but left alone, as nn.Linear subclasses: {skipped[:8]}" if skipped else ""
        raise ValueError(
            f"apply_lora: no nn.Linear matches target_modules={config.target_modules!r}; "
            f"plain nn.Linear modules in this model include {linears or 'none'}{note}"
        )
    earlier = {id(f.weight) for _, m in lora_modules(model) for f in (m.lora_A, m.lora_B)}
    for p in model.parameters():
        if id(p) not in earlier:
            p.requires_grad_(False)
    for name, linear_module in matched:
        _set_submodule(model, name, LoRALinear.from_linear(linear_module, config))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    model.lora_summary = {
        "modules": [n for n, _ in matched], "skipped": skipped, "trainable": trainable, "total": total,
    }
    log = logger.info if verbose else logger.debug
    log(
        "apply_lora: %d modules adapted; trainable params: %s / %s (%.4f%%)",
        len(matched), f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1),
    )
    if skipped:
        log("apply_lora: left alone %d matching nn.Linear subclasses: %s", len(skipped), skipped[:8])
    return model


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALayer]]:
    """Every LoRA layer in ``model`` (single-device or tensor-parallel), by dotted name."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer):
            yield name, module
