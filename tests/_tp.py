"""What the tensor-parallel layer tests share (``tests/tp/``, gloo on CPU at tp = 1, 2 and 4).

Reference: the single-device ``LoRALinear`` pair built from the *same full tensors* (``.full_tensor()`` of
every DTensor parameter), cast to float64 (a bf16 base is bf16-rounded first, so the reference sees exactly
the values the shards hold), run by plain autograd; for dropout, the dense fp64 ``tests/_reference``
math with the mask the layer used. The model under test is the Megatron MLP pair
``row(gelu(column(x)))`` with bias, ``r = 3`` (divides no TP size > 1) and random non-zero ``B`` (the
default ``B = 0`` would make ``dA = 0`` and hide half of the LoRA path).

Tolerances, ``|got - ref| <= atol * max|ref| + rtol * |ref|`` elementwise (``TOL`` below):

| compute dtype | atol  | rtol  | why |
|---------------|-------|-------|-----|
| fp32          | 1e-5  | 1e-5  | fp32 everywhere; only summation order differs (dots of <= 24 terms split |
|               |       |       | over ranks and re-summed by the all-reduce; fp32 gelu): ~24 * 2^-24        |
| bf16 base     | 3e-2  | 2e-2  | x, the column output, the gelu and the row partials are each rounded to   |
|               |       |       | bf16 (2^-8 each); partials are summed in bf16 on the wire; fp32 adapters  |

Exact (bitwise) where nothing is reduced or rounded: initialization, frozen base weights after training,
replicated factors across ranks. Each numeric test also shows its check can fail (the same comparison
against the base-only output, a perturbed replica, the un-offset mask, the full-x byte count).

Dropout seeds are read by recording each LoRA call's plan and seed (``tp/test_layers_dropout.recording_dropouts``);
the reference rebuilds the full-width mask from that seed with ``k_offset = 0``. Every rank's generator is
seeded alike, as the layers require.

Collectives are counted with ``CommDebugMode`` per phase; their dtypes are recorded by
``tests/_dist.CollectiveRecorder``. Adapter-gradient reductions are told apart from activation
collectives by rank: adapters are 2-D, activations here are always ``[batch, seq, features]``.
All ranks run in a pool shared across tests (``tests/_dist.py``); GPU variants are marked ``gpu``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear
from tests import _dist

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
K, H, N, R = 16, 24, 16, 3  # in, hidden (column out = row in), out, LoRA rank
BATCH, SEQ = 2, 8  # M = 16 tokens; SEQ divides by every TP size for sequence parallelism
ALPHA = 6.0  # scale 2: the LoRA term is as large as the base term
TOL = {F32: (1e-5, 1e-5), BF16: (3e-2, 2e-2)}  # (atol relative to max|ref|, rtol); reasons in the docstring
WORLD_SIZES = (1, 2, 4)
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16-base-fp32-adapters"])
SP = pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
gpu = pytest.mark.gpu


def tp_config(dropout: float = 0.0) -> LoRAConfig:
    return LoRAConfig(r=R, alpha=ALPHA, dropout=dropout, lora_dtype=F32, backend="auto")


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    torch.testing.assert_close(
        got.detach().to(F64), ref.detach().to(F64), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def full_pair(dtype: torch.dtype, dropout: float = 0.0) -> tuple[LoRALinear, LoRALinear]:
    """Seeded single-device column/row ``LoRALinear``s with random B and bias (identical on every rank)."""
    torch.manual_seed(1234)
    col = LoRALinear(K, H, tp_config(dropout), bias=True, dtype=dtype, device=_dist.device())
    row = LoRALinear(H, N, tp_config(dropout), bias=True, dtype=dtype, device=_dist.device())
    with torch.no_grad():
        for m in (col, row):
            m.lora_B.weight.normal_(0.0, 0.5)
            m.bias.normal_()
    return col, row


def reference_of(*modules: LoRALinear) -> list[LoRALinear]:
    """fp64 single-device copies (a bf16 base converts to fp64 exactly) on the eager backend, the oracle."""
    refs = [copy.deepcopy(m).to(F64) for m in modules]
    for ref in refs:
        ref.config = dataclasses.replace(ref.config, backend="torch")
    return refs


def tp_pair(dtype: torch.dtype, sp: bool, dropout: float = 0.0):
    """(column, row, fp64 column reference, fp64 row reference) from the same full tensors."""
    mesh = _dist.mesh()
    col, row = full_pair(dtype, dropout)
    col_ref, row_ref = reference_of(col, row)
    # Ranks seeded differently while converting: rank 0's values must win.
    torch.manual_seed(100 + dist.get_rank())
    ColumnParallelLoRALinear.from_lora_linear(col, mesh, sp)
    RowParallelLoRALinear.from_lora_linear(row, mesh, sp)
    torch.manual_seed(4321)  # the data that follows is the same on every rank
    return col, row, col_ref, row_ref


def seq_shard(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's sequence shard (dim 1) under SP, else the full tensor."""
    if not sp:
        return t
    return t.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]


def adapters(*modules: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters() if "lora_" in n]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def op_counts(mode: CommDebugMode) -> dict[str, int]:
    # CommDebugMode keys are op packets (e.g. c10d_functional.all_reduce, c10d.allreduce_): keep the
    # collective's one name.
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        counts[_dist.C10D_NAMES.get(name, name)] += n
    return {name: n for name, n in counts.items() if n}

