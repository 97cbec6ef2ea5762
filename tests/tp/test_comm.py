"""The collectives the tensor-parallel layers issue: per phase, against the base layers', and their dtypes
(counted with ``CommDebugMode`` and ``tests/_dist.CollectiveRecorder``; see ``tests/_tp.py``)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from parallel_lora.tp._layouts import LAYOUTS
from tests import _dist
from tests._tp import (
    BATCH,
    BF16,
    DTYPES,
    F32,
    SEQ,
    SP,
    H,
    K,
    close,
    gpu,
    op_counts,
    seq_shard,
    tp_pair,
)

AR, AG, RS = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"
# (forward, backward) per layer kind and SP; the backward includes dx (x requires grad).
EXPECTED = {
    ("column", False): ({}, {AR: 2}),  # bwd: dx, dA
    ("column", True): ({AG: 1}, {RS: 1, AG: 1, AR: 1}),  # fwd: x; bwd: dx, x re-gathered for dA, dA
    ("row", False): ({AR: 1}, {AR: 1}),  # fwd: the partial sum; bwd: dB
    ("row", True): ({RS: 1}, {AG: 1, AR: 1}),  # fwd: partial sum; bwd: dy, dB
}
# What the same layer issues with its adapter disabled (the base layer alone).
BASE = {
    ("column", False): ({}, {AR: 1}),
    ("column", True): ({AG: 1}, {RS: 1}),
    ("row", False): ({AR: 1}, {}),
    ("row", True): ({RS: 1}, {AG: 1}),
}


def _phase_counts(layers, x: torch.Tensor) -> tuple[dict, dict]:
    with CommDebugMode() as fwd:
        y = x
        for layer in layers:
            y = layer(y)
    with CommDebugMode() as bwd:
        y.sum().backward()
    return op_counts(fwd), op_counts(bwd)


def _collective_counts(sp: bool) -> None:
    col, row, _, _ = tp_pair(F32, sp)
    tp = dist.get_world_size()
    x_col = seq_shard(torch.randn(BATCH, SEQ, K), sp).requires_grad_(True)
    x_row = torch.randn(BATCH, SEQ, H // tp, requires_grad=True)
    for kind, layer, x in (("column", col, x_col), ("row", row, x_row)):
        got = _phase_counts([layer], x)
        assert got == EXPECTED[kind, sp], f"{kind} (sp={sp}): got (fwd, bwd) {got}, expected {EXPECTED[kind, sp]}"
        layer.adapter_enabled = False
        base = _phase_counts([layer], x)
        layer.adapter_enabled = True
        assert base == BASE[kind, sp], f"{kind} base layer (sp={sp}): {base}"
        # The LoRA path adds nothing to the forward; in backward only the adapter-gradient all-reduce (and,
        # for a column layer under SP, the re-gather of the x shard it saved instead of the full x).
        extra = Counter(got[1]) - Counter(base[1])
        assert got[0] == base[0], f"{kind}: the LoRA path added forward collectives {got[0]} vs {base[0]}"
        assert extra == Counter({AR: 1, **({AG: 1} if kind == "column" and sp else {})}), f"{kind}: {extra}"
    pair = _phase_counts([col, row], x_col)
    want = tuple(dict(Counter(EXPECTED["column", sp][i]) + Counter(EXPECTED["row", sp][i])) for i in range(2))
    assert pair == want, f"column->row (sp={sp}): got {pair}, expected {want}"


@pytest.mark.parametrize("world_size", [2, 4])
@SP
def test_collectives_per_phase_are_the_base_layers_plus_one_adapter_grad_reduction(world_size, sp):
    _dist.run_ranks(world_size, _collective_counts, sp)


def _frozen_replicated_factor_adds_no_collective(sp: bool) -> None:
    """Freezing the replicated factor (A of a column layer, as LoRA-FA does; B of a row layer) leaves the base
    layer's collectives alone: no gradient is computed for it, nor all-reduced. The other factor's gradient is
    unchanged."""
    tp = dist.get_world_size()
    x_col = seq_shard(torch.randn(BATCH, SEQ, K), sp).requires_grad_(True)
    x_row = torch.randn(BATCH, SEQ, H // tp, requires_grad=True)
    for kind, index, x in (("column", 0, x_col), ("row", 1, x_row)):
        layers = tp_pair(F32, sp)
        trained = copy.deepcopy(layers[index])
        layer = layers[index]
        replicated = getattr(layer, LAYOUTS[kind].replicated_factor).weight
        replicated.requires_grad_(False)
        other = "lora_B" if LAYOUTS[kind].replicated_factor == "lora_A" else "lora_A"
        got = _phase_counts([layer], x)
        assert got == BASE[kind, sp], f"{kind} (sp={sp}), replicated factor frozen: {got}, expected {BASE[kind, sp]}"
        assert replicated.grad is None, f"{kind}: the frozen factor got a gradient"
        _phase_counts([trained], x)
        want = getattr(trained, other).weight.grad
        close(getattr(layer, other).weight.grad.full_tensor(), want.full_tensor(), F32, f"{kind}: {other}.grad")


@pytest.mark.parametrize("world_size", [2, 4])
@SP
def test_a_frozen_replicated_factor_adds_no_collective(world_size, sp):
    _dist.run_ranks(world_size, _frozen_replicated_factor_adds_no_collective, sp)


def _one_rank_issues_no_collective(sp: bool) -> None:
    col, row, _, _ = tp_pair(F32, sp)
    x = torch.randn(BATCH, SEQ, K, requires_grad=True)
    # (The same layers on two and four ranks issue the counts pinned by the test above.)
    assert _phase_counts([col, row], x) == ({}, {}), "sums and gathers over one rank are identities"


@pytest.mark.parametrize("world_size", [1])
@SP
def test_a_one_rank_group_issues_no_collective(world_size, sp):
    _dist.run_ranks(world_size, _one_rank_issues_no_collective, sp)


def _collective_dtypes(dtype: torch.dtype, sp: bool) -> None:
    col, row, _, _ = tp_pair(dtype, sp)
    x = seq_shard(torch.randn(BATCH, SEQ, K, device=_dist.device()), sp).requires_grad_(True)  # fp32 x
    with _dist.CollectiveRecorder() as rec:
        y = row(F.gelu(col(x)))
        y.float().square().sum().backward()
    if dist.get_world_size() == 1:
        assert rec.calls == [], f"a one-rank group must issue no collective, got {rec.calls}"
        return
    activations = [c for c in rec.calls if len(c.shape) == 3]
    adapter_grads = [c for c in rec.calls if len(c.shape) == 2]
    assert len(activations) == (5 if sp else 2) and len(adapter_grads) == 2, rec.calls
    for c in activations:
        assert c.dtype == dtype, f"activation collective {c} is not in the base output dtype {dtype}"
    for c in adapter_grads:
        assert c.dtype == F32, f"fp32 master-adapter grad reduced in {c.dtype}: {c}"


@pytest.mark.parametrize("world_size", [2])
@SP
@DTYPES
def test_activation_collectives_run_in_base_dtype_and_adapter_grads_in_fp32(world_size, sp, dtype):
    _dist.run_ranks(world_size, _collective_dtypes, dtype, sp)


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_nccl_activation_collectives_run_in_bf16(world_size):
    _dist.run_ranks(world_size, _collective_dtypes, BF16, True, backend="nccl")
