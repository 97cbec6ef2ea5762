"""Column- and row-parallel LoRA linears: DTensor parameters, plain local tensors in and out (Megatron's I/O).

Per-rank shapes and the collectives of each phase: docs/tensor_parallel.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .._dropout import SEED_BOUND, DropoutStream
from .._dtypes import cast_to, compute_dtype
from ..config import LoRAConfig
from ..functional import Plan, lora_apply
from ..layers import LoRALayer, LoRALinear
from ._comm import (
    DeferredGradReduction,
    ReducedOutput,
    ReduceScatterOutput,
    ReplicatedInput,
    SequenceGather,
    adapter_shards,
    input_comm,
    output_comm,
)
from ._layouts import LAYOUTS

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio increment: TP groups' seed offsets lie far apart


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"tensor-parallel LoRA layers need a 1-D mesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; "
            "pass the tensor-parallel slice, e.g. mesh['tp']"
        )


def rank_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of the mesh: the current CUDA device for a CUDA mesh."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _mesh_device(mesh: DeviceMesh, device: torch.device | str | None = None) -> torch.device:
    """``device`` (checked against the mesh), else meta under ``with torch.device("meta")``, else the mesh's."""
    if device is None and torch.get_default_device().type == "meta":
        device = "meta"
    if device is None:
        return rank_device(mesh)
    device = torch.device(device)
    if device.type not in (mesh.device_type, "meta"):
        raise ValueError(
            f"module device {device} does not match the mesh's device type '{mesh.device_type}' "
            "(or 'meta', to materialize later with to_empty() and reset_parameters())"
        )
    return device


class _ParallelLoRALinear(LoRALayer):
    kind: str = ""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: LoRAConfig,
        mesh: DeviceMesh,
        bias: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        sequence_dim: int = 1,
    ) -> None:
        super().__init__()
        _check_mesh(mesh)
        self._check_divisible(in_features, out_features, mesh.size())
        device = _mesh_device(mesh, device)
        # the global tensors in LoRALinear's order, so one seed gives one full layer at every TP size
        full = LoRALinear(in_features, out_features, config, bias=bias, dtype=dtype, device=device)
        self._distribute_from(full, mesh, sequence_parallel, sequence_dim)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: LoRAConfig,
        mesh: DeviceMesh,
        sequence_parallel: bool = False,
        *,
        sequence_dim: int = 1,
    ) -> _ParallelLoRALinear:
        """Shard a full ``nn.Linear`` (rank 0's copy is the source); fresh adapters drawn from global shapes."""
        full = LoRALinear.from_linear(linear, config)
        cls._check_shardable(full, mesh)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._distribute_from(full, mesh, sequence_parallel, sequence_dim)
        return layer

    @classmethod
    def from_lora_linear(
        cls, module: LoRALinear, mesh: DeviceMesh, sequence_parallel: bool = False, *, sequence_dim: int = 1
    ) -> _ParallelLoRALinear:
        """Shard a full ``LoRALinear`` in place (adapters from rank 0) and return it, as ``parallelize_module`` uses."""
        cls._check_shardable(module, mesh)
        module.__class__ = cls
        module._distribute_from(module, mesh, sequence_parallel, sequence_dim)
        return module

    @classmethod
    def _check_shardable(cls, module: LoRALinear, mesh: DeviceMesh) -> None:
        _check_mesh(mesh)
        if module.merged:
            raise ValueError("unmerge_lora() the module before sharding it: a merged base would shard its update twice")
        cls._check_divisible(module.in_features, module.out_features, mesh.size())
        _mesh_device(mesh, module.weight.device)

    @classmethod
    def _check_divisible(cls, in_features: int, out_features: int, tp: int) -> None:
        dim_name, size = ("out_features", out_features) if cls.kind == "column" else ("in_features", in_features)
        if size % tp != 0:
            raise ValueError(
                f"{cls.__name__}: {dim_name}={size} must be divisible by the tensor-parallel size {tp}"
            )

    def _distribute_from(self, src: LoRALinear, mesh: DeviceMesh, sequence_parallel: bool, sequence_dim: int) -> None:
        layout = LAYOUTS[self.kind]
        weight, bias = src.weight.detach(), None if src.bias is None else src.bias.detach()
        lora_A, lora_B = src.lora_A.weight.detach(), src.lora_B.weight.detach()
        self.in_features, self.out_features, self.config = src.in_features, src.out_features, src.config
        self.mesh, self.sequence_parallel, self.sequence_dim = mesh, sequence_parallel, sequence_dim
        self.grad_sync = True
        self._deferred_grad = DeferredGradReduction()
        group_id = int(mesh.mesh.flatten()[0].item())
        self._init_state(DropoutStream(offset=group_id * _SEED_STRIDE % SEED_BOUND))

        def param(t: torch.Tensor, placement, requires_grad: bool) -> nn.Parameter:
            return nn.Parameter(distribute_tensor(t, mesh, [placement], src_data_rank=0), requires_grad=requires_grad)

        self.weight = param(weight, layout.weight, False)
        self.bias = None if bias is None else param(bias, layout.bias, False)
        self.lora_A, self.lora_B = src.lora_A, src.lora_B  # containers kept; their weights become DTensors
        self.lora_A.weight = param(lora_A, layout.lora_A, True)
        self.lora_B.weight = param(lora_B, layout.lora_B, True)

    @property
    def tp_size(self) -> int:
        return self.mesh.size()

    def _group(self):
        return self.mesh.get_group()

    def _check_input(self, x: torch.Tensor, width: int) -> None:
        if self.weight.is_meta:
            raise RuntimeError(
                f"{type(self).__name__}: the parameters are on the meta device; materialize them first with "
                "to_empty(device=...), then reset_parameters() or a state dict"
            )
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            raise TypeError(f"{type(self).__name__} takes a plain local torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: x must be floating point, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != width:
            raise ValueError(
                f"{type(self).__name__}: expected input of last dimension {width} "
                f"({self._width_note()}), got shape {tuple(x.shape)}"
            )
        if x.device.type != self.mesh.device_type:
            raise ValueError(
                f"{type(self).__name__}: input on {x.device}, but the mesh is on '{self.mesh.device_type}'"
            )
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(
                f"{type(self).__name__}: sequence_parallel needs x with at least 2 dims ([tokens, hidden] or one "
                f"with a sequence dim {self.sequence_dim}), got shape {tuple(x.shape)}"
            )
        d = self.sequence_dim
        if self.sequence_parallel and x.dim() > 2 and not (-x.dim() <= d < x.dim() and d % x.dim() != x.dim() - 1):
            raise ValueError(
                f"{type(self).__name__}: sequence_dim={self.sequence_dim} is not a dim of x other than the last "
                f"(the hidden dim), x has shape {tuple(x.shape)}"
            )

    def _width_note(self) -> str:
        return f"in_features={self.in_features}"

    def _seq_dim(self, x: torch.Tensor) -> int:
        """The dim of ``x`` that SP shards: ``sequence_dim``, but 0 for a 2-D ``[tokens, hidden]`` input."""
        return 0 if x.dim() == 2 else self.sequence_dim

    def _lora(self, x: torch.Tensor, weight, bias: torch.Tensor | None, A, B) -> torch.Tensor:
        """The LoRA op on this rank's shards (``bias`` local, the rest as stored) under the plan of ``x``'s call
        signature (built and checked once)."""
        w_local = _local(weight)
        key_tensors = (w_local, bias, A._local_tensor, B._local_tensor)
        sp = (self.sequence_parallel, self.sequence_dim)  # they set the plan's collectives
        plan = self._call_plan(x, key_tensors, lambda: self._plan(x, w_local, bias, A, B), *sp)
        group = self._group()
        replicated = LAYOUTS[self.kind].replicated_factor
        factor = A if replicated == "lora_A" else B
        reduce = self._deferred_grad.reduces_in_graph(factor, self.grad_sync, group)
        a_local, b_local = adapter_shards(A, B, replicated, group, reduce)
        seed = self._dropout_stream.next_seed(x) if plan.p else None
        return lora_apply(x, w_local, bias, a_local, b_local, plan, seed)

    def _plan(self, x: torch.Tensor, w_local: torch.Tensor, bias: torch.Tensor | None, A, B) -> Plan:
        self._check_call(x)
        a_local, b_local = A._local_tensor, B._local_tensor
        return self._make_plan(x, w_local, bias, a_local, b_local, self._k_offset(), self._comms(x, self._group()))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
            f"r={c.r}, alpha={c.alpha}, bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLoRALinear(_ParallelLoRALinear):
    """Column-parallel LoRA linear: ``x [*, in]`` (SP: a sequence shard) -> ``[*, out/tp]`` in the base output dtype.

    ``W``, ``B`` and bias Shard(0), ``A`` replicated. With dropout, seed the TP ranks' generators alike."""

    kind = "column"

    def _check_call(self, x: torch.Tensor) -> None:
        self._check_input(x, self.in_features)

    def _comms(self, x: torch.Tensor, group) -> tuple:
        return SequenceGather(self._seq_dim(x), group) if self.sequence_parallel else ReplicatedInput(group), None

    def _k_offset(self) -> int:
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, A, B = self._stored()
        bias = None if bias is None else _local(bias)
        if self.adapter_enabled and not self.merged:
            return self._lora(x, weight, bias, A, B)
        self._check_call(x)
        w_local = _local(weight)
        dtype = compute_dtype(x, w_local)
        x = input_comm(cast_to(x, dtype), self._comms(x, self._group())[0])
        return nn.functional.linear(x, cast_to(w_local, dtype), cast_to(bias, dtype))


class RowParallelLoRALinear(_ParallelLoRALinear):
    """Row-parallel LoRA linear: ``x [*, in/tp]`` -> ``[*, out]`` (SP: a sequence shard) in the base output dtype.

    ``W`` and ``A`` Shard(1), ``B`` and bias replicated. With dropout, seed the TP ranks' generators alike."""

    kind = "row"

    def _width_note(self) -> str:
        return f"in_features/tp = {self.in_features}/{self.tp_size}, this rank's shard"

    def _check_call(self, x: torch.Tensor) -> None:
        tp = self.tp_size
        self._check_input(x, self.in_features // tp)
        if self.sequence_parallel and x.shape[self._seq_dim(x)] % tp != 0:
            raise ValueError(
                f"RowParallelLoRALinear: sequence length {x.shape[self._seq_dim(x)]} (dim {self._seq_dim(x)}) "
                f"must be divisible by the tensor-parallel size {tp} under sequence_parallel"
            )

    def _comms(self, x: torch.Tensor, group) -> tuple:
        return None, ReduceScatterOutput(self._seq_dim(x), group) if self.sequence_parallel else ReducedOutput(group)

    def _k_offset(self) -> int:
        return self.mesh.get_local_rank() * (self.in_features // self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, A, B = self._stored()
        if self.adapter_enabled and not self.merged:
            y = self._lora(x, weight, None, A, B)
        else:
            self._check_call(x)
            w_local = _local(weight)
            dtype = compute_dtype(x, w_local)
            y = nn.functional.linear(cast_to(x, dtype), cast_to(w_local, dtype))
            y = output_comm(y, self._comms(x, self._group())[1])
        if bias is not None:
            y = y + cast_to(_local(bias), y.dtype)
        return y


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local tensor; a frozen one skips ``to_local()``'s grad-mode switch (host time)."""
    if param.requires_grad:
        return param.to_local()
    return param._local_tensor


def parallel_lora_modules(model: nn.Module) -> Iterator[_ParallelLoRALinear]:
    """Every tensor-parallel LoRA layer in ``model``."""
    return (m for m in model.modules() if isinstance(m, _ParallelLoRALinear))


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Defer the replicated-factor gradient all-reduces of ``model``'s TP LoRA layers to the next synced backward.

    Run each micro-step but the last inside it, its forward and its backward; see docs/tensor_parallel.md."""
    modules = list(parallel_lora_modules(model))
    previous = [m.grad_sync for m in modules]
    for m in modules:
        m._deferred_grad.hook(getattr(m, LAYOUTS[m.kind].replicated_factor).weight, m._group())
        m.grad_sync = False
    try:
        yield
    finally:
        for m, p in zip(modules, previous, strict=True):
            m.grad_sync = p
