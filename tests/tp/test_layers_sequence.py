"""Sequence parallelism in the tensor-parallel layers: the saved x shard, ``sequence_dim=0``, 2-D inputs
(references and tolerances: ``tests/_tp.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from parallel_lora import ColumnParallelLoRALinear, RowParallelLoRALinear
from tests import _dist
from tests._tp import (
    BATCH,
    DTYPES,
    F32,
    F64,
    SEQ,
    H,
    K,
    N,
    R,
    close,
    full_tensor,
    tp_config,
    tp_pair,
)


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, list]:
    """Bytes autograd saves for ``layer(x)``, parameters (by storage) excluded."""
    param_storages = {p.to_local().untyped_storage().data_ptr() for p in layer.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(s[2] for s in saved), saved


def _sp_column_saves_local_shard(dtype: torch.dtype) -> None:
    mesh, tp = _dist.mesh(), dist.get_world_size()
    col = ColumnParallelLoRALinear(K, H, tp_config(), mesh, sequence_parallel=True, dtype=dtype)
    x_local = torch.randn(BATCH, SEQ // tp, K, requires_grad=True)  # fp32 x: the saved copy is the cast one
    got, saved = _saved_bytes(col, x_local)
    # x's local shard + S = s * x A^T [M, r] (M = all BATCH * SEQ tokens), in the compute dtype, and the adapters'
    # compute-dtype copies where they are stored in another dtype (parameter-sized, not activations).
    A, B = col.lora_A.weight.to_local(), col.lora_B.weight.to_local()
    casts = (A.numel() + B.numel()) * dtype.itemsize if A.dtype != dtype else 0
    want = x_local.numel() * dtype.itemsize + BATCH * SEQ * R * dtype.itemsize + casts
    assert got == want, f"saved {got} bytes, expected {want} (local x shard + [M, r]); saved: {saved}"
    # The check can fail: a layer that keeps the gathered x saves tp times the shard.
    full = ColumnParallelLoRALinear(K, H, tp_config(), mesh, sequence_parallel=False, dtype=dtype)
    got_full, _ = _saved_bytes(full, torch.randn(BATCH, SEQ, K, requires_grad=True))
    assert got_full == want + (tp - 1) * x_local.numel() * dtype.itemsize, (got_full, want)
    assert got_full != got


@pytest.mark.parametrize("world_size", [2, 4])
@DTYPES
def test_sequence_parallel_column_saves_only_its_local_x_shard(world_size, dtype):
    _dist.run_ranks(world_size, _sp_column_saves_local_shard, dtype)


def _sequence_first_sp_matches_plain_tp() -> None:
    """Megatron's ``[s, b, h]`` layout: SP along ``sequence_dim=0`` gives plain TP's output, input gradient and
    adapter gradients (dropout on: the masks follow the flattened rows, whatever dim is sharded)."""
    mesh, tp, rank = _dist.mesh(), dist.get_world_size(), dist.get_rank()
    cfg = tp_config(dropout=0.3)
    results = {}
    for sp in (False, True):
        torch.manual_seed(0)
        col = ColumnParallelLoRALinear(K, H, cfg, mesh, bias=True, sequence_parallel=sp, sequence_dim=0)
        row = RowParallelLoRALinear(H, N, cfg, mesh, bias=True, sequence_parallel=sp, sequence_dim=0)
        with torch.no_grad():
            for layer in (col, row):
                layer.lora_B.weight.to_local().copy_(torch.randn(layer.lora_B.weight.to_local().shape))
        torch.manual_seed(1)
        x_full = torch.randn(SEQ, BATCH, K)
        x = (x_full.chunk(tp, dim=0)[rank] if sp else x_full).clone().requires_grad_(True)
        y = row(F.gelu(col(x)))
        y.square().sum().backward()  # under SP, the ranks' local losses sum to the full one
        gather = (lambda t: torch.cat(_dist.all_gather_object(t.detach()), dim=0)) if sp else (lambda t: t.detach())
        dA, dB = full_tensor(col.lora_A.weight.grad), full_tensor(row.lora_B.weight.grad)
        results[sp] = [gather(y), gather(x.grad), dA, dB]
    for name, got, want in zip(("y", "x.grad", "column dA", "row dB"), results[True], results[False], strict=True):
        close(got, want, F32, f"sequence_dim=0 SP against plain TP: {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_along_dim_0_matches_plain_tensor_parallel(world_size):
    _dist.run_ranks(world_size, _sequence_first_sp_matches_plain_tp)


def _two_d_input_is_sequence_first() -> None:
    """A 2-D ``[tokens, hidden]`` input under SP, layers left at the default ``sequence_dim=1`` (the ``[b, s, h]``
    reading): the tokens (dim 0) are the sequence, for the column layer's gather and the row layer's
    reduce-scatter alike, and the result is the single-device layers' on the full tokens."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    col, row, col_ref, row_ref = tp_pair(F32, sp=True)
    assert (col.sequence_dim, row.sequence_dim) == (1, 1)
    x_full = torch.randn(BATCH * SEQ, K)
    x = x_full.chunk(tp, dim=0)[rank].clone().requires_grad_(True)
    y = row(F.gelu(col(x)))
    assert y.shape == (BATCH * SEQ // tp, N)
    y.square().sum().backward()  # the ranks' local losses sum to the full one
    x_ref = x_full.to(F64).requires_grad_(True)
    row_ref(F.gelu(col_ref(x_ref))).square().sum().backward()
    y_ref = row_ref(F.gelu(col_ref(x_full.to(F64))))

    def gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(_dist.all_gather_object(t.detach()), dim=0)

    close(gather(y), y_ref, F32, "2-D SP: y")
    close(gather(x.grad), x_ref.grad, F32, "2-D SP: x.grad")
    close(full_tensor(col.lora_A.weight.grad), col_ref.lora_A.weight.grad, F32, "2-D SP: column dA")
    close(full_tensor(row.lora_B.weight.grad), row_ref.lora_B.weight.grad, F32, "2-D SP: row dB")
    with pytest.raises(ValueError, match=r"sequence_parallel needs x with at least 2 dims"):
        col(torch.randn(K))


def test_sequence_parallel_on_a_2d_input_shards_its_token_dim():
    _dist.run_ranks(2, _two_d_input_is_sequence_first)


def _switching_sp_takes_effect() -> None:
    """``sequence_parallel`` set on a layer that has run: the next call of the same input shape gathers (column) or
    reduce-scatters (row), rather than reusing the plan of the plain call."""
    mesh, tp = _dist.mesh(), dist.get_world_size()
    col = ColumnParallelLoRALinear(K, H, tp_config(), mesh)
    row = RowParallelLoRALinear(H, N, tp_config(), mesh)
    x, h = torch.randn(BATCH, SEQ, K), torch.randn(BATCH, SEQ, H // tp)
    assert col(x).shape == (BATCH, SEQ, H // tp) and row(h).shape == (BATCH, SEQ, N)
    col.sequence_parallel = row.sequence_parallel = True
    assert col(x).shape == (BATCH, SEQ * tp, H // tp) and row(h).shape == (BATCH, SEQ // tp, N)
    col.sequence_dim = row.sequence_dim = 0
    assert col(x).shape == (BATCH * tp, SEQ, H // tp) and row(h).shape == (BATCH // tp, SEQ, N)


def test_switching_sequence_parallel_takes_effect_on_the_next_call():
    _dist.run_ranks(2, _switching_sp_takes_effect)
