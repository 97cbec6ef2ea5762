"""The functional LoRA op and its autograd Function (the backend choice: ``parallel_lora.backend``).

``lora_linear`` applies the dtype policy (``parallel_lora.dtypes``) at the boundary, *outside* the
autograd Function, then runs one backend on 2-D views:

    x [*, K] -> y [*, N] = x W^T + b + s * (drop(x) A^T) B^T,   y.dtype == the base output dtype

Saved for backward: ``x`` (the caller's tensor, in the compute dtype; no fp32 copy of a bf16 ``x``), the
parameters, and ``S = s * drop(x) A^T`` ``[M, r]``. Dropout masks are regenerated from the call's seed (``[1]``
int64 on the device, ``parallel_lora.dropout``). Under torch.compile(fullgraph=True) the Function traces whole: the
Triton backend through the ops registered in ``parallel_lora.ops``, the torch backend op by op.
The tensor-parallel layers call ``lora_linear_local`` on their shards (``parallel_lora.parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import eager
from .backend import resolve_backend
from .dropout import P_RANGE, Dropout, draw_seed, seed_tensor, valid_p
from .dtypes import autocast_off, canonicalize, cast_to, compute_dtype
from .ops import fused_backward, fused_forward


def _impl(backend: str) -> tuple[Callable, Callable]:
    """``(forward, backward)`` of a backend (the kernels check their operands at a layout's first call only).

    Under torch.compile the torch backend is traced op by op (Inductor fuses its masks and casts), and the Triton
    backend is one registered op per pass (``parallel_lora.ops``)."""
    if backend != "triton":
        return eager.forward, eager.backward
    return fused_forward, fused_backward


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [*, n]`` as ``[rows, n]`` (2-D inputs as they are: a reshape costs host time at every call)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class LoRALinearFunction(torch.autograd.Function):
    """One LoRA linear on already-canonicalized tensors.

    Inputs: ``x [*, K]``, ``W [N, K]``, ``b [N]`` and ``x``/``W``/``b`` in the compute dtype; ``A [r, K]``,
    ``B [N, r]`` in the compute dtype (fused path) or their own dtype (eager path). Output ``[*, N]`` in the
    compute dtype. Backward returns each gradient in its input's dtype; ``dW``/``db`` only if they require
    grad (the base is normally frozen). ``input_comm`` / ``output_comm`` (``parallel_lora.comm``) are a
    tensor-parallel layer's activation collectives, run inside this one node: the LoRA path shares them.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scale, dropout, backend, input_comm=None, output_comm=None):
        forward = _impl(backend)[0]
        # Tensor parallel (``parallel_lora.comm``): ``input_comm`` brings x to the full input (identity, or the
        # sequence-parallel all-gather, once for base and LoRA together) and sums dx over ranks in backward;
        # ``output_comm`` reduces the output partials, base and LoRA terms together. Under SP only the local
        # shard of x is saved (W is frozen, so only dA needs the full x, gathered again in backward).
        x_full = x if input_comm is None else input_comm.gather(x)
        x2d = _rows(x_full)
        with autocast_off(x.device.type):
            y2d, s_lora = forward(x2d, weight, bias, lora_A, lora_B, scale, dropout)
        ctx.save_for_backward(x, weight, lora_A, lora_B, s_lora)
        ctx.scale, ctx.dropout, ctx.backend = scale, dropout, backend
        ctx.input_comm, ctx.output_comm = input_comm, output_comm
        ctx.has_bias = bias is not None
        y = y2d if x_full.dim() == 2 else y2d.reshape(*x_full.shape[:-1], weight.shape[0])
        if output_comm is not None:
            y = output_comm.reduce(y)
        # detach(): hand autograd a plain tensor, not a view of our 2-D buffer (FSDP2 and in-place ops on
        # the output treat views of Function outputs specially). Same storage, no copy.
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        x, weight, lora_A, lora_B, s_lora = ctx.saved_tensors
        needs_dx, needs_dW, needs_db, needs_dA, needs_dB = ctx.needs_input_grad[:5]
        comm = ctx.input_comm
        if ctx.output_comm is not None:
            dy = ctx.output_comm.gather_grad(dy)
        x_full = x if comm is None or not (needs_dA or needs_dW) else comm.regather(x, dy)
        dy2d, x2d = _rows(dy), _rows(x_full)
        with autocast_off(x.device.type):
            dx, dA, dB = _impl(ctx.backend)[1](
                dy2d, x2d, weight, lora_A, lora_B, s_lora, ctx.scale, ctx.dropout,
                needs_dx=needs_dx, needs_dA=needs_dA, needs_dB=needs_dB,
            )
            # A trainable base is not the LoRA use case, but its gradient must not be silently dropped.
            dW = dy2d.t() @ x2d if needs_dW else None
            db = dy2d.sum(0) if needs_db and ctx.has_bias else None
        if dx is not None:
            if dy.dim() != 2:
                dx = dx.reshape(*dy.shape[:-1], x.shape[-1])
            if comm is not None:
                dx = comm.scatter_grad(dx)
        return dx, dW, db, dA, dB, None, None, None, None, None


def check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the expected shapes and dtypes."""
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


def _check_seed(seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != device:
        raise ValueError(
            f"dropout_seed must be a 1-element int64 tensor on x's device ({device}), got a {seed.dtype} tensor of "
            f"shape {tuple(seed.shape)} on {seed.device}"
        )
    return seed.reshape(1)


def lora_linear_local(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    dropout: Dropout | None,
    backend: str,
) -> torch.Tensor:
    """Canonicalize dtypes and run the op on local tensors (a whole layer, or one rank's shards).

    ``backend`` must already be resolved. Returns the base output dtype.
    """
    cast_adapters = backend == "triton"
    _, x, weight, bias, lora_A, lora_B = canonicalize(x, weight, bias, lora_A, lora_B, cast_adapters=cast_adapters)
    return LoRALinearFunction.apply(x, weight, bias, lora_A, lora_B, float(scale), dropout, backend)


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
    """``y = x W^T + b + scale * (drop(x) A^T) B^T`` with dtype canonicalization.

    Args:
        x: ``[*, K]``, any float dtype; autocast-promoted fp32 activations compute in the autocast dtype.
        weight: ``[N, K]`` base weight (normally frozen); its dtype is the compute dtype outside autocast.
        bias: ``[N]`` or ``None``.
        lora_A, lora_B: ``[r, K]`` and ``[N, r]``, any float dtype (e.g. fp32 masters over a bf16 base).
        scale: ``alpha / r`` (or ``alpha / sqrt(r)``).
        dropout_p: dropout on the LoRA branch, active only when ``training``.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` or ``"torch"``.
        dropout_position: ``"pre"`` (on ``x``) or ``"post"`` (on ``x A^T``).
        dropout_seed: seed of the counter-based mask: ``None`` draws one on ``x``'s device from its default
            generator (``dropout.draw_seed``: no host sync, fresh at every CUDA graph replay, and an
            activation-checkpoint rerun draws the same one with ``preserve_rng_state=True``, the default, as
            ``nn.Dropout`` needs; the layers also detect a rerun without it and raise). A ``[1]`` int64 tensor on
            ``x``'s device is used as it is. An int (taken mod 2**64) is copied to the device at each call: a
            CUDA graph cannot capture it, and compiled code recompiles for each new value.

    Returns:
        ``[*, N]`` in exactly the base output dtype. Gradients come back in each input's own dtype.
    """
    check_inputs(x, weight, bias, lora_A, lora_B, scale)
    if not valid_p(dropout_p):
        raise ValueError(f"dropout_p must be in {P_RANGE}, got {dropout_p}")
    if dropout_position not in ("pre", "post"):
        raise ValueError(f"dropout_position must be 'pre' or 'post', got {dropout_position!r}")
    backend = resolve_backend(backend, x.device)
    dropout = None
    if training and dropout_p > 0.0:
        if dropout_seed is None:
            seed = draw_seed(x)
        elif isinstance(dropout_seed, torch.Tensor):
            seed = _check_seed(dropout_seed, x.device)
        else:
            seed = seed_tensor(dropout_seed, x.device)
        dropout = Dropout(p=float(dropout_p), seed=seed, position=dropout_position)
    return lora_linear_local(x, weight, bias, lora_A, lora_B, scale, dropout, backend)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The base layer alone (for ``disable_adapter`` and merged layers), with the same dtype rule."""
    dtype = compute_dtype(x, weight)
    return F.linear(cast_to(x, dtype), cast_to(weight, dtype), cast_to(bias, dtype))
