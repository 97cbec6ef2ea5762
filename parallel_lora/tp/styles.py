"""``ParallelStyle``s that turn ``LoRALinear``s into the tensor-parallel LoRA layers, in place."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..layers import LoRALinear
from .layers import ColumnParallelLoRALinear, RowParallelLoRALinear


class _LoRAStyle(ParallelStyle):
    layer_cls: type = ColumnParallelLoRALinear

    def __init__(
        self,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        use_local_output: bool = True,
        fallback: ParallelStyle | None = None,
    ):
        super().__init__()
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.use_local_output, self.fallback = use_local_output, fallback

    def _input_placement(self) -> Placement:
        raise NotImplementedError

    def _output_placement(self) -> Placement:
        raise NotImplementedError

    def _given_input_placement(self) -> Placement:
        """The caller's layout of a plain-tensor input; the hook turns it into ``_input_placement``."""
        return self._input_placement()

    def _wanted_output_placement(self) -> Placement:
        """What the caller gets; the hook turns ``_output_placement`` into it."""
        return self._output_placement()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear) and self.fallback is not None:
            return self.fallback._apply(module, device_mesh)
        if not isinstance(module, LoRALinear):
            raise TypeError(
                f"{type(self).__name__} applies to LoRALinear modules (run apply_lora first), "
                f"got {type(module).__name__}"
            )
        self.layer_cls.from_lora_linear(
            module, device_mesh, self.sequence_parallel, sequence_dim=self.sequence_dim
        )
        want_in, given_in = self._input_placement(), self._given_input_placement()
        out_placement, want_out = self._output_placement(), self._wanted_output_placement()

        def to_local_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, *rest = args
            if not isinstance(x, DTensor) and given_in != want_in:
                x = DTensor.from_local(x, device_mesh, [given_in], run_check=False)
            if isinstance(x, DTensor):
                # Replicate -> Shard is a slice, no communication.
                x = x.redistribute(device_mesh, [want_in]).to_local()
            return (x, *rest)

        module.register_forward_pre_hook(to_local_input)
        if not self.use_local_output or want_out != out_placement:

            def to_wanted_output(_module: nn.Module, _args: Any, out: Any) -> Any:
                out = DTensor.from_local(out, device_mesh, [out_placement], run_check=False)
                out = out.redistribute(device_mesh, [want_out])
                return out.to_local() if self.use_local_output else out

            module.register_forward_hook(to_wanted_output)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim}, "
            f"{self._layout_repr()}use_local_output={self.use_local_output})"
        )

    def _layout_repr(self) -> str:
        return ""


class ColwiseParallelLoRA(_LoRAStyle):
    """Column-parallel LoRA style (run ``apply_lora`` first): input replicated, output ``Shard(-1)``.

    Keyword Args: ``sequence_parallel`` (input sharded along ``sequence_dim``, default 1), ``gather_output``
    (all-gather the output), ``use_local_output`` (plain tensors out, default), ``fallback`` (the style for modules
    that are not ``LoRALinear``).
    """

    layer_cls = ColumnParallelLoRALinear

    def __init__(self, *, gather_output: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.gather_output = gather_output

    def _input_placement(self) -> Placement:
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _output_placement(self) -> Placement:
        return Shard(-1)

    def _wanted_output_placement(self) -> Placement:
        return Replicate() if self.gather_output else Shard(-1)

    def _layout_repr(self) -> str:
        return f"gather_output={self.gather_output}, "


class RowwiseParallelLoRA(_LoRAStyle):
    """Row-parallel LoRA: input ``Shard(-1)``, output replicated (reduce-scattered under ``sequence_parallel``).

    Keyword Args: as ``ColwiseParallelLoRA`` but ``input_is_parallel`` (default True) for ``gather_output``; False:
    every rank passes the whole input and keeps its slice.
    """

    layer_cls = RowParallelLoRALinear

    def __init__(self, *, input_is_parallel: bool = True, **kwargs: Any):
        super().__init__(**kwargs)
        self.input_is_parallel = input_is_parallel

    def _input_placement(self) -> Placement:
        return Shard(-1)

    def _given_input_placement(self) -> Placement:
        return Shard(-1) if self.input_is_parallel else Replicate()

    def _output_placement(self) -> Placement:
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _layout_repr(self) -> str:
        return f"input_is_parallel={self.input_is_parallel}, "


class _KeepRequiresGrad(ParallelStyle):
    """A torch style, then each parameter's ``requires_grad`` again (``SequenceParallel`` makes fresh ones)."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        module = self.style._apply(module, device_mesh)
        for name, p in module.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        return module

    def __repr__(self) -> str:
        return f"_KeepRequiresGrad({self.style!r})"


def _placement(placements: Any) -> Placement:
    return placements[0] if isinstance(placements, (tuple, list)) else placements


def _shard_dim(placements: Any) -> int | None:
    placement = _placement(placements)
    return placement.dim if isinstance(placement, Shard) else None


class _Unsupported(ParallelStyle):
    """A torch style the LoRA layers cannot match: kept for plain modules, a ``ValueError`` on a ``LoRALinear``."""

    def __init__(self, style: ParallelStyle, reason: str) -> None:
        super().__init__()
        self.style, self.reason = style, reason

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, LoRALinear):
            raise ValueError(f"lora_plan: {self.reason}")
        return self.style._apply(module, device_mesh)


def _lora_style(name: str, style: ColwiseParallel | RowwiseParallel) -> ParallelStyle:
    """The LoRA style with ``style``'s layouts, or ``_Unsupported``."""
    colwise = isinstance(style, ColwiseParallel)
    seq_side, last_side = (style.input_layouts, style.output_layouts) if colwise else (
        style.output_layouts, style.input_layouts)
    seq_dim, last = _shard_dim(seq_side), _placement(last_side)
    seq_ok = isinstance(_placement(seq_side), Replicate) or (seq_dim is not None and seq_dim >= 0)
    last_ok = last == Shard(-1) or isinstance(last, Replicate)
    if not (seq_ok and last_ok):
        last_kind, seq_kind = ("output", "input") if colwise else ("input", "output")
        return _Unsupported(style, (
            f"'{name}': {type(style).__name__}(input_layouts={_placement(style.input_layouts)}, output_layouts="
            f"{_placement(style.output_layouts)}) on a LoRA layer: its {last_kind} must be Shard(-1) or "
            f"Replicate(), and its {seq_kind} Replicate() or Shard(d) along a sequence dim d >= 0"
        ))
    common = dict(sequence_parallel=seq_dim is not None, sequence_dim=seq_dim if seq_dim is not None else 1,
                  use_local_output=style.use_local_output, fallback=style)
    if colwise:
        return ColwiseParallelLoRA(gather_output=isinstance(last, Replicate), **common)
    return RowwiseParallelLoRA(input_is_parallel=not isinstance(last, Replicate), **common)


def lora_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Map a torch TP plan onto the LoRA styles, layouts included (docs/tensor_parallel.md has the table).

    Un-adapted modules keep the torch style; other styles are kept, leaving frozen parameters frozen.
    """
    mapped: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            mapped[name] = _lora_style(name, style)
        else:
            mapped[name] = _KeepRequiresGrad(style)
    return mapped
