"""Collectives of the tensor-parallel layers, on plain local tensors.

Each collective runs in the dtype of the tensor it is given; the layers hand them tensors already in the
base output dtype (bf16 stays bf16 on the wire) and fp32 master-adapter gradients in fp32.

A layer's activation communication is two small objects that ``LoRAFunction`` calls inside its own
forward and backward, so the LoRA path and the base share each collective and add no autograd node:

| object                | where                  | forward               | backward                 |
|-----------------------|------------------------|-----------------------|--------------------------|
| ``ReplicatedInput``   | column input           | identity              | all-reduce of dx         |
| ``SequenceGather``    | column input, SP       | all-gather(seq dim)   | reduce-scatter of dx     |
| ``ReducedOutput``     | row output             | all-reduce            | identity                 |
| ``ReduceScatterOutput`` | row output, SP       | reduce-scatter(seq)   | all-gather of dy         |

``input_comm`` / ``output_comm`` apply the same objects as autograd nodes of their own, for the base-only
paths (merged or disabled adapters). ``adapter_shards`` turns the two adapter DTensor parameters into
local tensors in one node whose backward all-reduces the replicated factor's gradient once (or, under ``no_sync``,
leaves it to ``DeferredGradReduction``'s hook) and hands autograd DTensor gradients.

Under torch.compile every collective is a functional collective (``_c10d_functional``), which Dynamo traces into
the graph; eager calls keep in-place c10d all-reduces (host time, ``all_reduce``). The same collectives run either
way, in the same places.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.library import custom_op


def all_reduce(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``t`` over ``group``, in place when ``t`` is contiguous (every caller hands over a tensor it owns:
    a kernel's output or a gradient). In-place c10d skips the functional collective's output copy and its
    ``AsyncCollectiveTensor`` wrapper, which cost more host time than the collective's launch; the current
    stream waits for it, the host does not. Under torch.compile: the functional all-reduce (a new tensor), which
    traces. A one-rank group sums nothing."""
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
    # all_gather_tensor is deprecated (FutureWarning) in newer torch in favour of all_gather_single: same op.
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(ag(t.contiguous(), dim, group))


def reduce_scatter(t: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return t
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(rs(t.contiguous(), "sum", dim, group))


# ------------------------------------------------------------------------------------ activation layouts
class ReplicatedInput:
    """A column-parallel layer's replicated input: every rank has the full ``x``; ``dx`` is the sum of the
    ranks' partial input gradients (base and LoRA terms together), one all-reduce."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def regather(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return x

    def scatter_grad(self, dx: torch.Tensor) -> torch.Tensor:
        return all_reduce(dx, self.group)


class SequenceGather:
    """A column-parallel layer's sequence-parallel input: ``x`` is this rank's sequence shard, gathered once
    for base and LoRA together; ``dx`` is reduce-scattered back. ``LoRAFunction`` saves only the
    shard and gathers it again in backward (W is frozen, so only ``dA`` needs the full ``x``)."""

    def __init__(self, dim: int, group: ProcessGroup) -> None:
        self.dim, self.group = dim, group

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        return all_gather(x_local, self.dim, self.group)

    def regather(self, x_local: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """``gather`` again in backward (``dy``: the backward's incoming gradient). Compiled, of
        ``parallel_lora::after_grad(x_local, dy)``: a gather of ``x_local`` alone would be merged into the forward's
        by AOTAutograd (common subexpressions), or run in the forward with its output saved (its partitioner
        keeps collectives out of backward unless they need a gradient), and the full x would be held."""
        if torch.compiler.is_compiling():
            x_local = torch.ops.parallel_lora.after_grad(x_local, dy)
        return all_gather(x_local, self.dim, self.group)

    def scatter_grad(self, dx_full: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(dx_full, self.dim, self.group)


@custom_op("parallel_lora::after_grad", mutates_args=())
def _after_grad(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that the graph computes only once ``grad`` exists (opaque: no pass removes the edge)."""
    return t.clone()


@_after_grad.register_fake
def _(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


class ReducedOutput:
    """A row-parallel layer's output: the ranks' partials (base and LoRA together) summed by one all-reduce;
    the full ``dy`` is already on every rank."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, self.group)

    def gather_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return dy


class ReduceScatterOutput:
    """A row-parallel layer's sequence-parallel output: partials summed and scattered along the sequence
    dim (one reduce-scatter); backward all-gathers ``dy``."""

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


# ----------------------------------------------------------------------------------------- adapter shards
class _AdapterShards(torch.autograd.Function):
    """``(A, B)`` DTensor parameters -> their local tensors, eagerly. Backward: the replicated factor's gradient
    is a Partial sum over TP ranks, all-reduced here once when ``reduce`` (else left local: ``no_sync``); both
    gradients go back as DTensors with their parameter's placements."""

    @staticmethod
    def forward(ctx, lora_A, lora_B, replicated, group, reduce):
        ctx.set_materialize_grads(False)
        ctx.params, ctx.replicated, ctx.group, ctx.reduce = (lora_A, lora_B), replicated, group, reduce
        # Grad mode is off in here, so to_local() is the local tensor itself; views give autograd fresh
        # tensor objects to attach its metadata to.
        a, b = lora_A.to_local(), lora_B.to_local()
        a, b = a.view_as(a), b.view_as(b)
        # A Function's outputs all require grad by default: a frozen factor (e.g. A in LoRA-FA) would then
        # have its gradient computed and, replicated, all-reduced, only for autograd to drop it.
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
    """Identity forward; backward sums the gradient over ``group`` (the compiled form of ``_AdapterShards``'
    reduction: ``DTensor.to_local`` traces, and its backward builds the DTensor gradient in the graph)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


def param_grad(grad: torch.Tensor, param: DTensor) -> DTensor:
    """The local gradient ``grad`` of DTensor ``param`` as a DTensor with the parameter's placements.

    Where the local layouts agree (shape, stride, dtype: the kernels' fresh contiguous gradients), it is built
    on the parameter's own spec, as DTensor's ``to_local`` backward builds its gradients; ``from_local``
    derives a new spec instead, twice per backward on autograd's device thread, about half again the host time
    of the whole TP layer's fwd+bwd. Any other layout goes through ``from_local``."""
    local = param._local_tensor
    if grad.shape == local.shape and grad.stride() == local.stride() and grad.dtype == local.dtype:
        return DTensor(grad, param._spec, requires_grad=False)
    return DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)


def adapter_shards(
    lora_A: torch.nn.Parameter, lora_B: torch.nn.Parameter, replicated: str, group: ProcessGroup, reduce: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local tensors of the adapter DTensors (their own dtype); ``replicated`` names the factor every rank
    holds whole (``"lora_A"`` or ``"lora_B"``), whose gradient is all-reduced in backward when ``reduce``.

    Eager: one autograd node (``_AdapterShards``) that builds the DTensor gradients on the parameters' own specs.
    Under torch.compile: ``to_local()`` of each, the replicated one through ``_ReduceGrad``, all traced."""
    index = ("lora_A", "lora_B").index(replicated)
    if not torch.compiler.is_compiling():
        return _AdapterShards.apply(lora_A, lora_B, index, group, reduce)
    shards = [lora_A.to_local(), lora_B.to_local()]
    if reduce and (lora_A, lora_B)[index].requires_grad:
        shards[index] = _ReduceGrad.apply(shards[index], group)
    return shards[0], shards[1]


class DeferredGradReduction:
    """``no_sync`` for one layer's replicated factor: its gradient all-reduce runs once per optimizer step.

    A call under ``no_sync`` leaves its local partial sum in ``.grad``. The first synced call after such calls does
    not reduce in its backward either: a hook on the parameter reduces everything autograd has accumulated in
    ``.grad`` (the micro-steps' partial sums and its own) once, after the accumulation, in the autograd engine,
    outside any compiled graph (``reduce_accumulated_grad``). Every other call reduces in its own backward. Decided
    in the forward from plain attributes, so a compiled forward decides alike (Dynamo guards on them). Every
    micro-step's backward must have run before the synced step's forward.
    """

    def __init__(self) -> None:
        self.unreduced = False  # .grad holds (or its pending backwards will add) unreduced partial sums
        self.reduce_on_accumulate = False  # the hook reduces .grad at the next accumulation
        self._hooked: weakref.ref | None = None  # the parameter the hook is on

    def reduces_in_graph(self, param: torch.nn.Parameter, sync: bool, group: ProcessGroup) -> bool:
        """Whether this forward call's backward all-reduces ``param``'s gradient itself (``sync``: not in
        ``no_sync``). A call that makes no gradient for it (no_grad, as a reentrant checkpoint's first pass; a
        frozen factor) changes nothing."""
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
        """Put the deferred reduction's hook on ``param``, once per parameter object (deep copies and ``to_empty``
        bring new ones)."""
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
    """Sum ``param.grad`` (a DTensor, or a plain tensor) over ``group`` in place, once: the local partial sums that
    ``no_sync`` micro-steps and the synced backward accumulated there, reduced after the accumulation."""
    grad = param.grad
    if grad is None:
        return
    local = grad._local_tensor if isinstance(grad, DTensor) else grad
    with torch.no_grad():
        reduced = all_reduce(local, group)
        if reduced is not local:  # a non-contiguous .grad was reduced in a contiguous copy
            local.copy_(reduced)
