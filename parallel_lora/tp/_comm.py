"""Collectives of the tensor-parallel layers on local tensors (docs/tensor_parallel.md counts them per phase)."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from .._library import define


def all_reduce(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``t`` over ``group``: in place when contiguous (callers own ``t``), functional under torch.compile."""
    if group.size() == 1:
        return t
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def all_gather(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return t
    # all_gather_tensor is deprecated in newer torch in favour of all_gather_single, the same op.
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(ag(t.contiguous(), dim, group))


def reduce_scatter(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return t
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(rs(t.contiguous(), "sum", dim, group))


class ReplicatedInput:
    """Column input. Forward: identity; backward: all-reduce ``dx`` (base and LoRA together)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def regather(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return x

    def scatter_grad(self, dx: torch.Tensor) -> torch.Tensor:
        return all_reduce(dx, self.group)


class SequenceGather:
    """Column input under SP. Forward: all-gather ``x`` along ``dim``; backward: reduce-scatter ``dx``."""

    def __init__(self, dim: int, group: ProcessGroup) -> None:
        self.dim, self.group = dim, group

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        return all_gather(x_local, self.dim, self.group)

    def regather(self, x_local: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """``gather`` again in backward, after ``dy`` exists when compiled (docs/tensor_parallel.md)."""
        if torch.compiler.is_compiling():
            x_local = torch.ops.parallel_lora.after_grad(x_local, dy)
        return all_gather(x_local, self.dim, self.group)

    def scatter_grad(self, dx_full: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(dx_full, self.dim, self.group)


def _after_grad(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that the graph computes only once ``grad`` exists (opaque: no pass removes the edge)."""
    return t.clone()


def _after_grad_fake(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


define("after_grad", "(Tensor t, Tensor grad) -> Tensor", _after_grad, _after_grad_fake)


class ReducedOutput:
    """Row output. Forward: all-reduce the partial (base and LoRA together); backward: identity."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, self.group)

    def gather_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return dy


class ReduceScatterOutput:
    """Row output under SP. Forward: reduce-scatter the partial along ``dim``; backward: all-gather ``dy``."""

    def __init__(self, dim: int, group: ProcessGroup) -> None:
        self.dim, self.group = dim, group

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(partial, self.dim, self.group)

    def gather_grad(self, dy_local: torch.Tensor) -> torch.Tensor:
        return all_gather(dy_local, self.dim, self.group)


class _InputComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x_full = comm.gather(x)
        return x_full.view_as(x_full) if x_full is x else x_full  # a fresh tensor object for autograd

    @staticmethod
    def backward(ctx, dx_full):
        return ctx.comm.scatter_grad(dx_full), None


class _OutputComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, comm):
        ctx.comm = comm
        y = comm.reduce(partial)
        return y.view_as(y) if y is partial else y

    @staticmethod
    def backward(ctx, dy):
        return ctx.comm.gather_grad(dy), None


def input_comm(x: torch.Tensor, comm: ReplicatedInput | SequenceGather) -> torch.Tensor:
    """``comm.gather`` as an autograd node (backward ``comm.scatter_grad``), for base-only column paths."""
    return _InputComm.apply(x, comm)


def output_comm(partial: torch.Tensor, comm: ReducedOutput | ReduceScatterOutput) -> torch.Tensor:
    """``comm.reduce`` as an autograd node (backward ``comm.gather_grad``), for base-only row paths."""
    return _OutputComm.apply(partial, comm)


class _AdapterShards(torch.autograd.Function):
    """Forward: local tensors of ``(A, B)``; backward: all-reduce the replicated factor's grad, return DTensors."""

    @staticmethod
    def forward(ctx, lora_A, lora_B, replicated, group, reduce):
        ctx.set_materialize_grads(False)
        ctx.params, ctx.replicated, ctx.group, ctx.reduce = (lora_A, lora_B), replicated, group, reduce
        # Grad mode is off here, so to_local() is the local tensor itself: views give autograd fresh objects.
        a, b = lora_A.to_local(), lora_B.to_local()
        a, b = a.view_as(a), b.view_as(b)
        # Otherwise a frozen factor's gradient would be computed (and all-reduced) only to be dropped.
        frozen = [t for t, p in ((a, lora_A), (b, lora_B)) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return a, b

    @staticmethod
    def backward(ctx, da, db):
        grads = [da, db]
        i = ctx.replicated
        if grads[i] is not None and ctx.reduce:
            grads[i] = all_reduce(grads[i], ctx.group)
        da, db = (None if g is None else param_grad(g, p) for g, p in zip(grads, ctx.params, strict=True))
        return da, db, None, None, None


class _ReduceGrad(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (``_AdapterShards``' reduction under torch.compile)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


def param_grad(grad: torch.Tensor, param: DTensor) -> DTensor:
    """``grad`` as a DTensor like ``param``, on its spec where local layouts agree (``from_local`` costs host time)."""
    local = param._local_tensor
    if grad.shape == local.shape and grad.stride() == local.stride() and grad.dtype == local.dtype:
        return DTensor(grad, param._spec, requires_grad=False)
    return DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)


def adapter_shards(
    lora_A: torch.nn.Parameter, lora_B: torch.nn.Parameter, replicated: str, group: ProcessGroup, reduce: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local tensors of the adapter DTensors; backward all-reduces the ``replicated`` factor's grad if ``reduce``."""
    index = ("lora_A", "lora_B").index(replicated)
    if not torch.compiler.is_compiling():
        return _AdapterShards.apply(lora_A, lora_B, index, group, reduce)
    shards = [lora_A.to_local(), lora_B.to_local()]
    if reduce and (lora_A, lora_B)[index].requires_grad:
        shards[index] = _ReduceGrad.apply(shards[index], group)
    return shards[0], shards[1]


class DeferredGradReduction:
    """``no_sync`` for one layer's replicated factor: after ``no_sync`` calls, the synced call's gradient is
    all-reduced once, by a hook after accumulation, instead of in its backward."""

    def __init__(self) -> None:
        self.unreduced = False  # .grad holds (or its pending backwards will add) unreduced partial sums
        self.reduce_on_accumulate = False  # the hook reduces .grad at the next accumulation
        self._hooked: weakref.ref | None = None

    def reduces_in_graph(self, param: torch.nn.Parameter, sync: bool, group: ProcessGroup) -> bool:
        """Whether this call's backward all-reduces ``param``'s gradient itself (``sync``: not under ``no_sync``)."""
        if not (param.requires_grad and torch.is_grad_enabled()):
            return True
        if not sync:
            if not torch.compiler.is_compiling():  # no_sync hooks it too (a compiled forward cannot)
                self.hook(param, group)
            self.unreduced = True
            return False
        if self.unreduced:
            self.reduce_on_accumulate = True
            return False
        return True

    def hook(self, param: torch.nn.Parameter, group: ProcessGroup) -> None:
        """Put the deferred reduction's hook on ``param``, once per parameter object."""
        if self._hooked is not None and self._hooked() is param:
            return
        param.register_post_accumulate_grad_hook(functools.partial(_reduce_deferred, weakref.ref(self), group))
        self._hooked = weakref.ref(param)


def _reduce_deferred(state_ref: weakref.ref, group: ProcessGroup, param: torch.nn.Parameter) -> None:
    state = state_ref()
    if state is None or not state.reduce_on_accumulate or state._hooked() is not param:
        return  # nothing deferred, or a parameter its layer no longer holds
    reduce_accumulated_grad(param, group)
    state.unreduced = state.reduce_on_accumulate = False


def reduce_accumulated_grad(param: torch.nn.Parameter, group: ProcessGroup) -> None:
    """Sum ``param.grad`` (a DTensor or a plain tensor) over ``group``, in place."""
    grad = param.grad
    if grad is None:
        return
    local = grad._local_tensor if isinstance(grad, DTensor) else grad
    with torch.no_grad():
        reduced = all_reduce(local, group)
        if reduced is not local:  # a non-contiguous .grad was reduced in a contiguous copy
            local.copy_(reduced)
