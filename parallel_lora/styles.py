"""``ParallelStyle``s that turn ``LoRALinear``s into the tensor-parallel LoRA layers.

Use them in ``torch.distributed.tensor.parallel.parallelize_module`` plans like torch's
``ColwiseParallel``/``RowwiseParallel``; ``lora_plan`` maps an existing torch plan onto them.
``parallelize_module`` ignores what a style returns for a submodule, so ``_apply`` converts the module
in place (``ColumnParallelLoRALinear.from_lora_linear``) and installs I/O hooks, nothing else.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .layers import LoRALinear
from .parallel import ColumnParallelLoRALinear, RowParallelLoRALinear


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
        want_in, out_placement = self._input_placement(), self._output_placement()

        def to_local_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, *rest = args
            if isinstance(x, DTensor):
                # Accept DTensor activations from other styles (e.g. SequenceParallel norms).
                x = x.redistribute(device_mesh, [want_in]).to_local()
            return (x, *rest)

        module.register_forward_pre_hook(to_local_input)
        if not self.use_local_output:

            def to_dtensor_output(_module: nn.Module, _args: Any, out: Any) -> DTensor:
                return DTensor.from_local(out, device_mesh, [out_placement], run_check=False)

            module.register_forward_hook(to_dtensor_output)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim}, "
            f"use_local_output={self.use_local_output})"
        )


class ColwiseParallelLoRA(_LoRAStyle):
    """Column-parallel LoRA: input replicated (sequence-sharded with ``sequence_parallel``), output sharded
    on the last dim. The stored ``[out, in]`` weight is ``Shard(0)`` so each rank owns ``out/tp`` rows.

    Keyword Args:
        sequence_parallel: the input is sharded along ``sequence_dim``; the layer gathers it once.
        sequence_dim: the sequence dimension of the input (torch's ``SequenceParallel`` default, 1).
        use_local_output: return a plain local tensor (default) rather than a ``Shard(-1)`` DTensor.
        fallback: a style applied instead to modules that are not ``LoRALinear`` (``lora_plan`` passes the
            torch style it replaced, so un-adapted linears keep torch's behaviour).

    Example::

        parallelize_module(model, tp_mesh, {"attn.q_proj": ColwiseParallelLoRA(), "attn.o_proj": RowwiseParallelLoRA()})

    .. note:: apply ``apply_lora`` first: the style converts ``LoRALinear`` modules in place.
    """

    layer_cls = ColumnParallelLoRALinear

    def _input_placement(self) -> Placement:
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()

    def _output_placement(self) -> Placement:
        return Shard(-1)


class RowwiseParallelLoRA(_LoRAStyle):
    """Row-parallel LoRA: input sharded on the last dim, output replicated (sequence-sharded with
    ``sequence_parallel``). The stored ``[out, in]`` weight is ``Shard(1)``.

    Keyword Args: as ``ColwiseParallelLoRA``; with ``sequence_parallel`` the output is reduce-scattered
    along ``sequence_dim``.
    """

    layer_cls = RowParallelLoRALinear

    def _input_placement(self) -> Placement:
        return Shard(-1)

    def _output_placement(self) -> Placement:
        return Shard(self.sequence_dim) if self.sequence_parallel else Replicate()


class _KeepRequiresGrad(ParallelStyle):
    """Apply a torch style, then restore each parameter's ``requires_grad``: torch's ``SequenceParallel``
    re-registers norm weights as fresh ``nn.Parameter``s, which would unfreeze what ``apply_lora`` froze."""

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


def _shard_dim(placements: Any) -> int | None:
    placement = placements[0] if isinstance(placements, (tuple, list)) else placements
    return placement.dim if isinstance(placement, Shard) else None


def lora_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Map a torch TP plan onto the LoRA styles: ``ColwiseParallel`` -> ``ColwiseParallelLoRA`` and
    ``RowwiseParallel`` -> ``RowwiseParallelLoRA``, with sequence parallelism read off their layouts
    (a ``Shard(d)`` input of a colwise / output of a rowwise style). Other styles (``SequenceParallel``,
    ``PrepareModuleInput``, ...) are kept, except that frozen parameters stay frozen.

    Modules under a mapped entry that ``apply_lora`` did not adapt keep the original torch style.
    """
    mapped: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if isinstance(style, ColwiseParallel):
            dim = _shard_dim(style.input_layouts)
            mapped[name] = ColwiseParallelLoRA(
                sequence_parallel=dim is not None, sequence_dim=dim if dim is not None else 1,
                use_local_output=style.use_local_output, fallback=style,
            )
        elif isinstance(style, RowwiseParallel):
            dim = _shard_dim(style.output_layouts)
            mapped[name] = RowwiseParallelLoRA(
                sequence_parallel=dim is not None, sequence_dim=dim if dim is not None else 1,
                use_local_output=style.use_local_output, fallback=style,
            )
        else:
            mapped[name] = _KeepRequiresGrad(style)
    return mapped
