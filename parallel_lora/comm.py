"""Differentiable collectives on plain local tensors, used by the tensor-parallel layers.

Each collective runs in the dtype of the tensor it is given; the layers hand them tensors already in the
base output dtype (bf16 stays bf16 on the wire) and fp32 master-adapter gradients in fp32.

| function             | forward             | backward            |
|----------------------|---------------------|---------------------|
| ``copy_to_tp``       | identity            | all-reduce          |
| ``reduce_from_tp``   | all-reduce          | identity            |
| ``reduce_scatter_sp``| reduce-scatter(dim) | all-gather(dim)     |
| ``SequenceGather``   | all-gather(dim)     | reduce-scatter(dim) |
| ``reduce_replicated_grad`` | identity      | all-reduce, deferred under ``no_sync`` |
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup


def all_reduce(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))


def all_gather(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    # all_gather_tensor is deprecated (FutureWarning) in newer torch in favour of all_gather_single: same op.
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(ag(t.contiguous(), dim, group))


def reduce_scatter(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(rs(t.contiguous(), "sum", dim, group))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return all_reduce(dx, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        return all_reduce(partial, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ReduceScatterSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(partial, dim, group)

    @staticmethod
    def backward(ctx, dy_local):
        return all_gather(dy_local, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Replicated input of a column-parallel layer: its gradient is summed over TP ranks once."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(partial: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum the per-rank partial outputs of a row-parallel layer (one all-reduce)."""
    return _ReduceFromTP.apply(partial, group)


def reduce_scatter_sp(partial: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Row-parallel output under sequence parallelism: sum partials and keep this rank's sequence shard."""
    return _ReduceScatterSP.apply(partial, dim, group)


class SequenceGather:
    """Sequence-parallel input of a column-parallel layer, for ``LoRALinearFunction``'s ``input_gather``.

    The Function gathers ``x`` in forward and saves only the local shard; backward gathers it again (W is
    frozen, so only ``dA`` needs the full ``x``) and reduce-scatters ``dx``.
    """

    def __init__(self, dim: int, group: ProcessGroup) -> None:
        self.dim, self.group = dim, group

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        return all_gather(x_local, self.dim, self.group)

    def scatter_grad(self, dx_full: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(dx_full, self.dim, self.group)


class _ReduceReplicatedGrad(torch.autograd.Function):
    """Identity on a replicated factor's local tensor; its gradient, a Partial sum over TP ranks, is
    all-reduced once here, or left local while the owning module is inside ``no_sync``."""

    @staticmethod
    def forward(ctx, local, param, group, sync):
        ctx.param, ctx.group, ctx.sync = param, group, sync
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        param = ctx.param
        if not ctx.sync:
            param._lora_grad_unreduced = True
            return grad, None, None, None
        if getattr(param, "_lora_grad_unreduced", False) and param.grad is not None:
            # Earlier no_sync micro-steps left their partial sums in .grad: reduce them together with this
            # step's, in the same single all-reduce, and let autograd accumulate the total.
            pending = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad = grad + pending.to(grad.dtype)
            pending.zero_()
        param._lora_grad_unreduced = False
        return all_reduce(grad, ctx.group), None, None, None


def reduce_replicated_grad(
    local: torch.Tensor, param: torch.nn.Parameter, group: ProcessGroup, sync: bool
) -> torch.Tensor:
    return _ReduceReplicatedGrad.apply(local, param, group, sync)
