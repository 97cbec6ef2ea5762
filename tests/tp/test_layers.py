"""The column -> row LoRA MLP at tp = 1, 2, 4 against the single-device fp64 layers: outputs, gradients,
AdamW steps with clipping and accumulation, ``no_sync`` (references and tolerances: ``tests/_tp.py``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from parallel_lora import no_sync
from tests import _dist
from tests._tp import (
    BATCH,
    BF16,
    DTYPES,
    F32,
    F64,
    SEQ,
    SP,
    WORLD_SIZES,
    K,
    N,
    adapters,
    close,
    full_tensor,
    gpu,
    seq_shard,
    tp_pair,
)


def _mlp_matches_reference(dtype: torch.dtype, sp: bool) -> None:
    col, row, col_ref, row_ref = tp_pair(dtype, sp)
    dev = _dist.device()
    x_full = torch.randn(BATCH, SEQ, K, device=dev)  # fp32 activation even for a bf16 base: cast inside
    dy_full = torch.randn(BATCH, SEQ, N, device=dev).to(dtype)

    x = seq_shard(x_full, sp).clone().requires_grad_(True)
    y = row(F.gelu(col(x)))
    y.backward(seq_shard(dy_full, sp))

    x64 = x_full.to(dtype).to(F64).requires_grad_(True)
    y64 = row_ref(F.gelu(col_ref(x64)))
    y64.backward(dy_full.to(F64))

    assert y.dtype == dtype, f"output dtype {y.dtype} != base dtype {dtype}"
    assert x.grad.dtype == x.dtype, f"x.grad dtype {x.grad.dtype} != x dtype {x.dtype}"
    close(y, seq_shard(y64, sp), dtype, "y")
    close(x.grad, seq_shard(x64.grad, sp), dtype, "x.grad")
    for (name, p), (_, p_ref) in zip(adapters(col, row), adapters(col_ref, row_ref), strict=True):
        assert isinstance(p.grad, DTensor), f"{name}.grad is {type(p.grad).__name__}, not a DTensor"
        assert p.grad.placements == p.placements, f"{name}.grad placements {p.grad.placements} != {p.placements}"
        assert p.grad.dtype == p.dtype == F32, f"{name}: fp32 master adapter got a {p.grad.dtype} grad"
        close(p.grad.full_tensor(), p_ref.grad, dtype, f"{name}.grad")
    for m in (col, row):
        assert m.weight.grad is None and m.bias.grad is None, "the frozen base got a gradient"

    # The check can fail: the same comparison against the base alone (LoRA term dropped) must not pass.
    for m in (col_ref, row_ref):
        m.adapter_enabled = False
    with pytest.raises(AssertionError):
        close(y, seq_shard(row_ref(F.gelu(col_ref(x64))), sp), dtype, "y vs base only")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@SP
@DTYPES
def test_column_row_mlp_matches_single_device_fp64(world_size, sp, dtype):
    _dist.run_ranks(world_size, _mlp_matches_reference, dtype, sp)


def _param_grads_take_the_parameter_spec_or_from_local() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallel_lora.tp._comm import param_grad

    mesh = _dist.mesh()
    tp = mesh.size()
    for placement in (Shard(0), Shard(1), Replicate()):
        param = nn.Parameter(distribute_tensor(torch.randn(8 * tp, 4 * tp), mesh, [placement]))
        local = param.to_local()
        grad = torch.randn_like(local)
        fast = param_grad(grad, param)
        assert fast._spec is param._spec and fast._local_tensor is grad and not fast.requires_grad
        # A layout the parameter's spec does not describe (transposed strides, another dtype) takes from_local.
        for other in (grad.t().contiguous().t(), grad.double()):
            slow = param_grad(other, param)
            assert slow._spec is not param._spec and slow.placements == param.placements
            assert slow.shape == param.shape and slow.dtype == other.dtype
            assert torch.equal(slow.full_tensor(), fast.full_tensor().to(other.dtype))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_adapter_grads_are_dtensors_on_the_parameter_spec_where_layouts_agree(world_size):
    # The adapters' gradients become DTensors at every backward (on autograd's device thread); building them
    # on the parameter's spec skips from_local's spec derivation, a third of the TP layers' host time.
    _dist.run_ranks(world_size, _param_grads_take_the_parameter_spec_or_from_local)


def _training_matches_reference(sp: bool, steps: int = 3, micro_steps: int = 2) -> None:
    """AdamW + clip_grad_norm_ on DTensor grads + gradient accumulation with no_sync, vs the fp64 run.

    fp32 only: Adam divides each gradient element by its own magnitude, so bf16-level noise on a near-zero
    element flips its update by up to 2 * lr; a bf16 run would test that, not the layers (whose bf16
    gradients ``test_column_row_mlp_matches_single_device_fp64`` checks directly)."""
    col, row, col_ref, row_ref = tp_pair(F32, sp)
    model, model_ref = nn.Sequential(col, nn.GELU(), row), nn.Sequential(col_ref, nn.GELU(), row_ref)
    params = [p for _, p in adapters(col, row)]
    params_ref = [p for _, p in adapters(col_ref, row_ref)]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(params_ref, lr=2e-2, weight_decay=0.1)
    base_before = {n: full_tensor(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    max_norm = 0.05
    for step in range(steps):
        for i in range(micro_steps):
            x_full, t_full = torch.randn(BATCH, SEQ, K), torch.randn(BATCH, SEQ, N)
            denom = t_full.numel() * micro_steps  # mean over the step's tokens; a rank's part under SP
            ctx = no_sync(model) if i < micro_steps - 1 else contextlib.nullcontext()
            with ctx:
                y = model(seq_shard(x_full, sp))
                ((y - seq_shard(t_full, sp)).square().sum() / denom).backward()
            ((model_ref(x_full.to(F64)) - t_full.to(F64)).square().sum() / denom).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(params_ref, max_norm)
        assert norm_ref > max_norm, f"step {step}: norm {norm_ref:.3g} <= max_norm, clipping is not exercised"
        close(full_tensor(norm), norm_ref, F32, f"step {step}: grad norm")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()

    for (name, p), (_, p_ref) in zip(adapters(col, row), adapters(col_ref, row_ref), strict=True):
        close(p.full_tensor(), p_ref, F32, f"{name} after {steps} steps")
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(full_tensor(p), base_before[name]), f"frozen {name} changed"
    # Replicated factors: bitwise identical on every rank (not just close), or ranks drift apart.
    _dist.assert_same_on_all_ranks(col.lora_A.weight.to_local(), "column lora_A")
    _dist.assert_same_on_all_ranks(row.lora_B.weight.to_local(), "row lora_B")
    if dist.get_world_size() > 1:  # the bitwise check can fail: perturb one rank's replica by one ulp
        a = col.lora_A.weight.to_local().clone()
        if dist.get_rank() == 1:
            a[0, 0] = torch.nextafter(a[0, 0], torch.tensor(1.0))
        with pytest.raises(AssertionError, match="rank 1 differs"):
            _dist.assert_same_on_all_ranks(a, "perturbed lora_A")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@SP
def test_adamw_steps_with_clipping_and_accumulation_match_single_device(world_size, sp):
    _dist.run_ranks(world_size, _training_matches_reference, sp)


def _no_sync_reduces_once(micro_steps: int = 3) -> None:
    col, row, _, _ = tp_pair(F32, sp=False)
    col2, row2 = copy.deepcopy(col), copy.deepcopy(row)
    deferred, synced = nn.Sequential(col, nn.GELU(), row), nn.Sequential(col2, nn.GELU(), row2)
    batches = [torch.randn(BATCH, SEQ, K, requires_grad=True) for _ in range(micro_steps)]
    adapter_reductions, activation_reductions = [], []
    for i, x in enumerate(batches):
        last = i == micro_steps - 1
        # Like DDP's no_sync, the context must cover the forward: the layers decide there whether to reduce.
        with _dist.CollectiveRecorder() as rec, contextlib.nullcontext() if last else no_sync(deferred):
            deferred(x).square().sum().backward()
        adapter_reductions.append(sum(c.op == "all_reduce" and len(c.shape) == 2 for c in rec.calls))
        activation_reductions.append(sum(c.op == "all_reduce" and len(c.shape) == 3 for c in rec.calls))
        synced(x).square().sum().backward()
        if i == 0 and dist.get_world_size() > 1:  # deferred: the grads are still this rank's partial sums
            with pytest.raises(AssertionError):
                _dist.assert_same_on_all_ranks(col.lora_A.weight.grad.to_local(), "deferred dA")
    # One all-reduce per replicated factor (column A, row B) per optimizer step, all in the last backward.
    assert adapter_reductions == [0] * (micro_steps - 1) + [2], adapter_reductions
    # Row output (fwd) and column dx (bwd): activation reductions are never deferred.
    assert activation_reductions == [2] * micro_steps, f"activation all-reduces: {activation_reductions}"
    for (name, p), (_, p2) in zip(adapters(col, row), adapters(col2, row2), strict=True):
        assert p.grad.placements == p.placements, name
        close(p.grad.full_tensor(), p2.grad.full_tensor(), F32, f"{name}.grad with vs without no_sync")
    _dist.assert_same_on_all_ranks(col.lora_A.weight.grad.to_local(), "column dA after the reducing backward")
    _dist.assert_same_on_all_ranks(row.lora_B.weight.grad.to_local(), "row dB after the reducing backward")


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_reduces_replicated_grads_once_and_matches_synced_grads(world_size):
    _dist.run_ranks(world_size, _no_sync_reduces_once)


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
@SP
def test_gpu_nccl_triton_bf16_mlp_matches_single_device_fp64(world_size, sp):
    """NCCL, one GPU per rank, ``backend="auto"`` (the fused Triton kernels on CUDA), bf16 base."""
    _dist.run_ranks(world_size, _mlp_matches_reference, BF16, sp, backend="nccl")
