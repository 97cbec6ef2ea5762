"""The LoRA op ``lora_linear``: a ``Plan`` per call signature and one autograd node; docs/design.md section 7."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _eager as eager
from ._dropout import Dropout, check_dropout, check_seed, draw_seed, seed_tensor
from ._dtypes import autocast_off, cast_to, compute_dtype
from .kernels import replay
from .kernels.host import interpreting, keep_at_most
from .kernels.ops import dispatch_module
from .kernels.program import Programs

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA (when Triton imports), ``"torch"`` otherwise; checks the others."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got tensors on {device}; use backend='torch' (or 'auto'), "
            "or set TRITON_INTERPRET=1 before importing parallel_lora to run the kernels in Triton's interpreter"
        )
    return backend


class Plan:
    """One call signature of a layer, settled once: backend, compute dtype, scale, dropout, collectives, sites."""

    def __init__(self, backend, dtype, scale, p, position, k_offset, input_comm=None, output_comm=None,
                 adapter_dtype=None, casts=True) -> None:
        self.backend, self.dtype, self.scale = backend, dtype, scale
        self.adapter_dtype = adapter_dtype  # what the adapters are cast to; None: the kernels read them as they are
        self.casts = casts  # whether a call casts an operand
        self.p, self.position, self.k_offset = p, position, k_offset
        self.mode = position if p > 0.0 else None
        self._mask_offset = k_offset if position == "pre" else 0
        self.input_comm, self.output_comm = input_comm, output_comm
        self.config = None  # the layer config a kept plan was built for (``LoRALayer._call_plan``)
        self.fwd_entry = None  # the forward's launch sites
        self.fwd_programs = Programs()  # its calls recorded for replay (kernels/program.py)
        self.bwd_entries: dict = {}  # per dy layout and wanted grads: (launch sites, Programs)
        # replay.cpp's state once a forward is recorded; False where a call casts or communicates
        self.replay = None if backend == "triton" and not casts and input_comm is output_comm is None else False

    def _dropout(self, seed: torch.Tensor | int | None) -> Dropout | None:
        return None if self.p == 0.0 else Dropout(self.p, seed, self.position, self.k_offset)

    def _op_scalars(self, seed: torch.Tensor | int | None) -> tuple:
        return self.scale, self.p, seed, self.position, self.k_offset

    def forward(self, x, weight, bias, lora_A, lora_B, seed) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [M, K]`` and the operands in the compute dtype -> ``(y [M, N], S [M, r])``."""
        if self.backend != "triton":
            return eager.forward(x, weight, bias, lora_A, lora_B, self.scale, self._dropout(seed))
        if torch.compiler.is_compiling():
            return torch.ops.parallel_lora.lora_forward(x, weight, bias, lora_A, lora_B, *self._op_scalars(seed))
        kernels, entry, mode = dispatch_module(), self.fwd_entry, self.mode
        first = entry is None
        if first:
            entry = kernels.forward_entry(x, weight, bias, lora_A, lora_B, mode)

        def call():
            return kernels.run_forward(entry, x, weight, bias, lora_A, lora_B, self.scale, self.p, seed, mode,
                                       self._mask_offset)

        if first:
            out = call()
            self.fwd_entry = entry  # kept only once run_forward has filled its sites
            return out
        out = self.fwd_programs.run(call, (x, weight, bias, lora_A, lora_B), seed)
        if self.replay is None and any(self.fwd_programs.by_stream.values()):
            self.replay = replay.module() is not None and (self.fwd_programs.by_stream, self.bwd_entries, _APPLY,
                                                           Plan.backward, self)  # fmt: skip
        return out

    def backward(self, dy, x, weight, lora_A, lora_B, s_lora, seed, needs: tuple[bool, bool, bool]) -> tuple:
        """``dy [M, N]`` and the forward's operands -> ``(dx, dA, dB)``, ``None`` where not wanted."""
        if self.backend != "triton":
            return eager.backward(dy, x, weight, lora_A, lora_B, s_lora, self.scale, self._dropout(seed), *needs)
        if torch.compiler.is_compiling():
            op = torch.ops.parallel_lora.lora_backward
            grads = op(dy, x, weight, lora_A, lora_B, s_lora, *self._op_scalars(seed), *needs)
            return tuple(g if needed else None for g, needed in zip(grads, needs, strict=True))
        kernels, mode = dispatch_module(), self.mode
        key = (dy.stride(), dy.data_ptr() & 15, needs)
        kept = self.bwd_entries.get(key)
        entry = kernels.backward_entry(dy, x, weight, lora_A, lora_B, s_lora, mode, *needs) if kept is None else kept[0]

        def call():
            return kernels.run_backward(entry, dy, x, weight, lora_A, lora_B, s_lora, self.scale, self.p, seed, mode,
                                        self._mask_offset, *needs)

        if kept is None:
            grads = call()
            if len(self.bwd_entries) < 8:  # a layer's dy comes in one or two layouts
                self.bwd_entries[key] = (entry, Programs())
            return grads
        return kept[1].run(call, (dy, x, weight, lora_A, lora_B, s_lora), seed)


class Plans(dict):
    """A layer's plans by call signature: at most ``KEPT``, the oldest going first; copies start empty."""

    KEPT = 64

    def keep(self, key: tuple, plan: Plan) -> Plan:
        return keep_at_most(self, key, plan, self.KEPT)

    def __deepcopy__(self, memo) -> Plans:
        return Plans()

    def __reduce__(self):
        return Plans, ()


def call_key(x, weight, bias, lora_A, lora_B, *more) -> tuple:
    """What a layer's plan depends on: x's layout, the autocast state, each parameter's layout, dtype, device and
    16-byte alignment (not its address: FSDP2 allocates its parameters anew at every step), ``more``."""
    device = x.device
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    return (x.shape, x.stride(), x.dtype, device, x.data_ptr() & 15, autocast,
            weight.shape, weight.stride(), weight.dtype, weight.get_device(), weight.data_ptr() & 15,
            lora_A.shape, lora_A.stride(), lora_A.dtype, lora_A.get_device(), lora_A.data_ptr() & 15,
            lora_B.shape, lora_B.stride(), lora_B.dtype, lora_B.get_device(), lora_B.data_ptr() & 15,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device(), bias.data_ptr() & 15),
            *more)  # fmt: skip


def make_plan(x, weight, bias, lora_A, lora_B, scale: float, backend: str, dropout_p: float, training: bool,
              position: str = "pre", k_offset: int = 0, input_comm=None, output_comm=None) -> Plan:
    """Check one call's operands (local shards) and settle its plan; dropout is active only when ``training``."""
    check_inputs(x, weight, bias, lora_A, lora_B, scale)
    check_dropout(dropout_p, position, k_offset)
    backend = resolve_backend(backend, x.device)
    dtype = compute_dtype(x, weight)
    # The kernels read adapters of one dtype as they are (fp32 masters included); the torch backend computes in dtype.
    adapter_dtype = None if backend == "triton" and lora_A.dtype == lora_B.dtype else dtype
    p = float(dropout_p) if training else 0.0
    adapters = lora_A.dtype if adapter_dtype is None else adapter_dtype
    operands = ((x, dtype), (weight, dtype), (bias, dtype), (lora_A, adapters), (lora_B, adapters))
    casts = any(t is not None and t.dtype != want for t, want in operands)
    return Plan(backend, dtype, float(scale), p, position, k_offset, input_comm, output_comm, adapter_dtype, casts)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class LoRAFunction(torch.autograd.Function):
    """``apply(x, W, b, A, B, plan, seed)``: any float dtypes -> ``[*, N]`` in the compute dtype, grads in theirs."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, plan, seed):
        if plan.casts:
            dtype = plan.dtype
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype, lora_A.dtype, lora_B.dtype)
            x, weight, bias = cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype)
            if plan.adapter_dtype is not None:
                lora_A, lora_B = cast_to(lora_A, plan.adapter_dtype), cast_to(lora_B, plan.adapter_dtype)
        x_full = x if plan.input_comm is None else plan.input_comm.gather(x)
        with autocast_off(x.device.type):
            y2d, s_lora = plan.forward(_rows(x_full), weight, bias, lora_A, lora_B, seed)
        ctx.save_for_backward(x, weight, lora_A, lora_B, s_lora)
        ctx.plan, ctx.seed, ctx.has_bias = plan, seed, bias is not None
        y = y2d if x_full.dim() == 2 else y2d.reshape(*x_full.shape[:-1], weight.shape[0])
        if plan.output_comm is not None:
            y = plan.output_comm.reduce(y)
        # not a view of the 2-D buffer: FSDP2 and in-place ops treat views of a Function's outputs specially
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        x, weight, lora_A, lora_B, s_lora = ctx.saved_tensors
        plan, seed = ctx.plan, ctx.seed
        needs_dx, needs_dW, needs_db, needs_dA, needs_dB = ctx.needs_input_grad[:5]
        if plan.output_comm is not None:
            dy = plan.output_comm.gather_grad(dy)
        comm = plan.input_comm
        x_full = x if comm is None or not (needs_dA or needs_dW) else comm.regather(x, dy)
        dy2d, x2d = _rows(dy), _rows(x_full)
        with autocast_off(dy.device.type):
            dx, dA, dB = plan.backward(dy2d, x2d, weight, lora_A, lora_B, s_lora, seed, (needs_dx, needs_dA, needs_dB))
            dW = dy2d.t() @ x2d if needs_dW else None
            db = dy2d.sum(0) if needs_db and ctx.has_bias else None
        if dx is not None:
            if dy.dim() != 2:
                dx = dx.reshape(*dy.shape[:-1], x.shape[-1])
            if comm is not None:
                dx = comm.scatter_grad(dx)
        if not plan.casts:  # every gradient is already in its tensor's dtype
            return dx, dW, db, dA, dB, None, None
        x_dtype, w_dtype, bias_dtype, a_dtype, b_dtype = ctx.dtypes
        return (cast_to(dx, x_dtype), cast_to(dW, w_dtype), cast_to(db, bias_dtype), cast_to(dA, a_dtype),
                cast_to(dB, b_dtype), None, None)


# The C half of ``LoRAFunction.apply``: its Python half only serves functorch transforms and setup_context.
_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, LoRAFunction)


def lora_apply(x, weight, bias, lora_A, lora_B, plan: Plan, seed) -> torch.Tensor:
    """``LoRAFunction.apply``, through its C half outside torch.compile; refuses torch.func transforms."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "parallel_lora's LoRA op has no torch.func rule (vmap, grad, jacrev, ...): call the layer outside the "
            "transform, e.g. loop over the batch instead of vmap, or use torch.autograd.grad for gradients"
        )
    if torch.compiler.is_compiling():
        return LoRAFunction.apply(x, weight, bias, lora_A, lora_B, plan, seed)
    if plan.replay:  # the recorded programs, run from C++ (kernels/replay.cpp)
        return replay.module().replay(plan.replay, x, weight, bias, lora_A, lora_B, seed)
    return _APPLY(x, weight, bias, lora_A, lora_B, plan, seed)


def check_inputs(x, weight, bias, lora_A, lora_B, scale: float) -> None:
    """Raise ``ValueError``/``TypeError`` naming the expected shapes and dtypes of one call's operands."""
    for name, t in (("x", x), ("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"x must have last dimension in_features={k} (weight is [{n}, {k}]), got shape {tuple(x.shape)}"
        )
    if lora_A.dim() != 2 or lora_A.shape[1] != k:
        raise ValueError(f"lora_A must be [r, in_features={k}], got shape {tuple(lora_A.shape)}")
    r = lora_A.shape[0]
    if tuple(lora_B.shape) != (n, r):
        raise ValueError(f"lora_B must be [out_features={n}, r={r}], got shape {tuple(lora_B.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [out_features={n}], got shape {tuple(bias.shape)}")
    devices = {t.device for t in (x, weight, bias, lora_A, lora_B) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"x, weight, bias, lora_A and lora_B must be on one device, got {sorted(map(str, devices))}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
    backend: str = "auto",
    *,
    dropout_position: str = "pre",
    dropout_seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``[*, N] = x W^T + b + scale * (drop(x) A^T) B^T`` in the base output dtype; grads in each input's dtype.

    Args:
        x, weight, bias: ``[*, K]``, ``[N, K]`` (normally frozen), ``[N]`` or None; any float dtypes.
        lora_A, lora_B: ``[r, K]``, ``[N, r]``; any float dtype (e.g. fp32 masters over a bf16 base).
        scale: ``alpha / r`` (or ``alpha / sqrt(r)``); dropout_p: on the LoRA branch, only when ``training``.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` or ``"torch"``.
        dropout_position: ``"pre"`` (on ``x``) or ``"post"`` (on ``x A^T``).
        dropout_seed: None draws one (``_dropout.draw_seed``); else a seed as ``_dropout.check_seed`` takes it.
    """
    plan = make_plan(x, weight, bias, lora_A, lora_B, scale, backend, dropout_p, training, dropout_position)
    seed = None
    if plan.p > 0.0:
        seed = draw_seed(x) if dropout_seed is None else check_seed(dropout_seed, x.device)
        if isinstance(seed, int) and torch.compiler.is_compiling():
            seed = seed_tensor(seed, x.device)  # the compiled op takes its seed as a tensor
    return lora_apply(x, weight, bias, lora_A, lora_B, plan, seed)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The base layer alone (for ``disable_adapter`` and merged layers), with the same dtype rule."""
    dtype = compute_dtype(x, weight)
    return F.linear(cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype))
