"""``ColumnParallelLoRALinear`` / ``RowParallelLoRALinear`` at tensor-parallel sizes 1, 2 and 4 (gloo on CPU).

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

Dropout seeds are read by wrapping the layer's ``_dropout(x, k_offset)`` (the one place a layer builds the
``Dropout`` of a forward call) and recording what it returns; the reference rebuilds the full-width mask
from that seed with ``k_offset = 0``. Every rank's generator is seeded alike, as the layers require.

Collectives are counted with ``CommDebugMode`` per phase; their dtypes are recorded by
``tests/_dist.CollectiveRecorder``. Adapter-gradient reductions are told apart from activation
collectives by rank: adapters are 2-D, activations here are always ``[batch, seq, features]``.
All ranks run in a pool shared across tests (``tests/_dist.py``); GPU variants are marked ``gpu``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import Counter

import _dist
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _recipes import reset_every_module
from _reference import lora_reference
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear, no_sync
from parallel_lora.dropout import Dropout, keep_mask
from parallel_lora.layouts import LAYOUTS

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
K, H, N, R = 16, 24, 16, 3  # in, hidden (column out = row in), out, LoRA rank
BATCH, SEQ = 2, 8  # M = 16 tokens; SEQ divides by every TP size for sequence parallelism
ALPHA = 6.0  # scale 2: the LoRA term is as large as the base term
TOL = {F32: (1e-5, 1e-5), BF16: (3e-2, 2e-2)}  # (atol relative to max|ref|, rtol); reasons in the docstring
WORLD_SIZES = (1, 2, 4)
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16-base-fp32-adapters"])
SP = pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------- helpers on the ranks
def _config(dropout: float = 0.0) -> LoRAConfig:
    return LoRAConfig(r=R, alpha=ALPHA, dropout=dropout, lora_dtype=F32, backend="auto")


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    torch.testing.assert_close(
        got.detach().to(F64), ref.detach().to(F64), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _full_pair(dtype: torch.dtype, dropout: float = 0.0) -> tuple[LoRALinear, LoRALinear]:
    """Seeded single-device column/row ``LoRALinear``s with random B and bias (identical on every rank)."""
    torch.manual_seed(1234)
    col = LoRALinear(K, H, _config(dropout), bias=True, dtype=dtype, device=_dist.device())
    row = LoRALinear(H, N, _config(dropout), bias=True, dtype=dtype, device=_dist.device())
    with torch.no_grad():
        for m in (col, row):
            m.lora_B.weight.normal_(0.0, 0.5)
            m.bias.normal_()
    return col, row


def _reference_of(*modules: LoRALinear) -> list[LoRALinear]:
    """fp64 single-device copies (a bf16 base converts to fp64 exactly) on the eager backend, the oracle."""
    refs = [copy.deepcopy(m).to(F64) for m in modules]
    for ref in refs:
        ref.config = dataclasses.replace(ref.config, backend="torch")
    return refs


def _tp_pair(dtype: torch.dtype, sp: bool, dropout: float = 0.0):
    """(column, row, fp64 column reference, fp64 row reference) from the same full tensors."""
    mesh = _dist.mesh()
    col, row = _full_pair(dtype, dropout)
    col_ref, row_ref = _reference_of(col, row)
    # Ranks seeded differently while converting: rank 0's values must win.
    torch.manual_seed(100 + dist.get_rank())
    ColumnParallelLoRALinear.from_lora_linear(col, mesh, sp)
    RowParallelLoRALinear.from_lora_linear(row, mesh, sp)
    torch.manual_seed(4321)  # the data that follows is the same on every rank
    return col, row, col_ref, row_ref


def _seq_shard(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's sequence shard (dim 1) under SP, else the full tensor."""
    if not sp:
        return t
    return t.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]


def _adapters(*modules: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters() if "lora_" in n]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _op_counts(mode: CommDebugMode) -> dict[str, int]:
    # CommDebugMode keys are op packets (e.g. c10d_functional.all_reduce, c10d.allreduce_): keep the
    # collective's one name.
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        counts[_dist.C10D_NAMES.get(name, name)] += n
    return {name: n for name, n in counts.items() if n}


# ------------------------------------------------------------------------------------------ numerics
def _mlp_matches_reference(dtype: torch.dtype, sp: bool) -> None:
    col, row, col_ref, row_ref = _tp_pair(dtype, sp)
    dev = _dist.device()
    x_full = torch.randn(BATCH, SEQ, K, device=dev)  # fp32 activation even for a bf16 base: cast inside
    dy_full = torch.randn(BATCH, SEQ, N, device=dev).to(dtype)

    x = _seq_shard(x_full, sp).clone().requires_grad_(True)
    y = row(F.gelu(col(x)))
    y.backward(_seq_shard(dy_full, sp))

    x64 = x_full.to(dtype).to(F64).requires_grad_(True)
    y64 = row_ref(F.gelu(col_ref(x64)))
    y64.backward(dy_full.to(F64))

    assert y.dtype == dtype, f"output dtype {y.dtype} != base dtype {dtype}"
    assert x.grad.dtype == x.dtype, f"x.grad dtype {x.grad.dtype} != x dtype {x.dtype}"
    _close(y, _seq_shard(y64, sp), dtype, "y")
    _close(x.grad, _seq_shard(x64.grad, sp), dtype, "x.grad")
    for (name, p), (_, p_ref) in zip(_adapters(col, row), _adapters(col_ref, row_ref), strict=True):
        assert isinstance(p.grad, DTensor), f"{name}.grad is {type(p.grad).__name__}, not a DTensor"
        assert p.grad.placements == p.placements, f"{name}.grad placements {p.grad.placements} != {p.placements}"
        assert p.grad.dtype == p.dtype == F32, f"{name}: fp32 master adapter got a {p.grad.dtype} grad"
        _close(p.grad.full_tensor(), p_ref.grad, dtype, f"{name}.grad")
    for m in (col, row):
        assert m.weight.grad is None and m.bias.grad is None, "the frozen base got a gradient"

    # The check can fail: the same comparison against the base alone (LoRA term dropped) must not pass.
    for m in (col_ref, row_ref):
        m.adapter_enabled = False
    with pytest.raises(AssertionError):
        _close(y, _seq_shard(row_ref(F.gelu(col_ref(x64))), sp), dtype, "y vs base only")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@SP
@DTYPES
def test_column_row_mlp_matches_single_device_fp64(world_size, sp, dtype):
    _dist.run_ranks(world_size, _mlp_matches_reference, dtype, sp)


def _param_grads_take_the_parameter_spec_or_from_local() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallel_lora.comm import param_grad

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
    col, row, col_ref, row_ref = _tp_pair(F32, sp)
    model, model_ref = nn.Sequential(col, nn.GELU(), row), nn.Sequential(col_ref, nn.GELU(), row_ref)
    params = [p for _, p in _adapters(col, row)]
    params_ref = [p for _, p in _adapters(col_ref, row_ref)]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(params_ref, lr=2e-2, weight_decay=0.1)
    base_before = {n: _full(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    max_norm = 0.05
    for step in range(steps):
        for i in range(micro_steps):
            x_full, t_full = torch.randn(BATCH, SEQ, K), torch.randn(BATCH, SEQ, N)
            denom = t_full.numel() * micro_steps  # mean over the step's tokens; a rank's part under SP
            ctx = no_sync(model) if i < micro_steps - 1 else contextlib.nullcontext()
            with ctx:
                y = model(_seq_shard(x_full, sp))
                ((y - _seq_shard(t_full, sp)).square().sum() / denom).backward()
            ((model_ref(x_full.to(F64)) - t_full.to(F64)).square().sum() / denom).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(params_ref, max_norm)
        assert norm_ref > max_norm, f"step {step}: norm {norm_ref:.3g} <= max_norm, clipping is not exercised"
        _close(_full(norm), norm_ref, F32, f"step {step}: grad norm")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()

    for (name, p), (_, p_ref) in zip(_adapters(col, row), _adapters(col_ref, row_ref), strict=True):
        _close(p.full_tensor(), p_ref, F32, f"{name} after {steps} steps")
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(_full(p), base_before[name]), f"frozen {name} changed"
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
    col, row, _, _ = _tp_pair(F32, sp=False)
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
    for (name, p), (_, p2) in zip(_adapters(col, row), _adapters(col2, row2), strict=True):
        assert p.grad.placements == p.placements, name
        _close(p.grad.full_tensor(), p2.grad.full_tensor(), F32, f"{name}.grad with vs without no_sync")
    _dist.assert_same_on_all_ranks(col.lora_A.weight.grad.to_local(), "column dA after the reducing backward")
    _dist.assert_same_on_all_ranks(row.lora_B.weight.grad.to_local(), "row dB after the reducing backward")


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_reduces_replicated_grads_once_and_matches_synced_grads(world_size):
    _dist.run_ranks(world_size, _no_sync_reduces_once)


# -------------------------------------------------------------------------------------- collectives
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
    return _op_counts(fwd), _op_counts(bwd)


def _collective_counts(sp: bool) -> None:
    col, row, _, _ = _tp_pair(F32, sp)
    tp = dist.get_world_size()
    x_col = _seq_shard(torch.randn(BATCH, SEQ, K), sp).requires_grad_(True)
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
    x_col = _seq_shard(torch.randn(BATCH, SEQ, K), sp).requires_grad_(True)
    x_row = torch.randn(BATCH, SEQ, H // tp, requires_grad=True)
    for kind, index, x in (("column", 0, x_col), ("row", 1, x_row)):
        layers = _tp_pair(F32, sp)
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
        _close(getattr(layer, other).weight.grad.full_tensor(), want.full_tensor(), F32, f"{kind}: {other}.grad")


@pytest.mark.parametrize("world_size", [2, 4])
@SP
def test_a_frozen_replicated_factor_adds_no_collective(world_size, sp):
    _dist.run_ranks(world_size, _frozen_replicated_factor_adds_no_collective, sp)


def _one_rank_issues_no_collective(sp: bool) -> None:
    col, row, _, _ = _tp_pair(F32, sp)
    x = torch.randn(BATCH, SEQ, K, requires_grad=True)
    # (The same layers on two and four ranks issue the counts pinned by the test above.)
    assert _phase_counts([col, row], x) == ({}, {}), "sums and gathers over one rank are identities"


@pytest.mark.parametrize("world_size", [1])
@SP
def test_a_one_rank_group_issues_no_collective(world_size, sp):
    _dist.run_ranks(world_size, _one_rank_issues_no_collective, sp)


def _collective_dtypes(dtype: torch.dtype, sp: bool) -> None:
    col, row, _, _ = _tp_pair(dtype, sp)
    x = _seq_shard(torch.randn(BATCH, SEQ, K, device=_dist.device()), sp).requires_grad_(True)  # fp32 x
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


# ------------------------------------------------------------------------------- memory, init, dropout
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
    col = ColumnParallelLoRALinear(K, H, _config(), mesh, sequence_parallel=True, dtype=dtype)
    x_local = torch.randn(BATCH, SEQ // tp, K, requires_grad=True)  # fp32 x: the saved copy is the cast one
    got, saved = _saved_bytes(col, x_local)
    # x's local shard in the compute dtype + S = s * x A^T [M, r] (M = all BATCH * SEQ tokens, adapter dtype).
    want = x_local.numel() * dtype.itemsize + BATCH * SEQ * R * F32.itemsize
    assert got == want, f"saved {got} bytes, expected {want} (local x shard + [M, r]); saved: {saved}"
    # The check can fail: a layer that keeps the gathered x saves tp times the shard.
    full = ColumnParallelLoRALinear(K, H, _config(), mesh, sequence_parallel=False, dtype=dtype)
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
    cfg = _config(dropout=0.3)
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
        results[sp] = [gather(y), gather(x.grad), _full(col.lora_A.weight.grad), _full(row.lora_B.weight.grad)]
    for name, got, want in zip(("y", "x.grad", "column dA", "row dB"), results[True], results[False], strict=True):
        _close(got, want, F32, f"sequence_dim=0 SP against plain TP: {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_along_dim_0_matches_plain_tensor_parallel(world_size):
    _dist.run_ranks(world_size, _sequence_first_sp_matches_plain_tp)


def _two_d_input_is_sequence_first() -> None:
    """A 2-D ``[tokens, hidden]`` input under SP, layers left at the default ``sequence_dim=1`` (the ``[b, s, h]``
    reading): the tokens (dim 0) are the sequence, for the column layer's gather and the row layer's
    reduce-scatter alike, and the result is the single-device layers' on the full tokens."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    col, row, col_ref, row_ref = _tp_pair(F32, sp=True)
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

    _close(gather(y), y_ref, F32, "2-D SP: y")
    _close(gather(x.grad), x_ref.grad, F32, "2-D SP: x.grad")
    _close(_full(col.lora_A.weight.grad), col_ref.lora_A.weight.grad, F32, "2-D SP: column dA")
    _close(_full(row.lora_B.weight.grad), row_ref.lora_B.weight.grad, F32, "2-D SP: row dB")
    with pytest.raises(ValueError, match=r"sequence_parallel needs x with at least 2 dims"):
        col(torch.randn(K))


def test_sequence_parallel_on_a_2d_input_shards_its_token_dim():
    _dist.run_ranks(2, _two_d_input_is_sequence_first)


def _init_independent_of_tp(seed: int) -> None:
    mesh, rank = _dist.mesh(), dist.get_rank()
    cfg = _config()
    for cls, (fan_in, fan_out) in ((ColumnParallelLoRALinear, (K, H)), (RowParallelLoRALinear, (H, N))):
        torch.manual_seed(seed)
        ref = LoRALinear(fan_in, fan_out, cfg, bias=True)
        # Every rank seeded differently: the result must still be rank 0's draw (src_data_rank=0).
        torch.manual_seed(seed + rank)
        layer = cls(fan_in, fan_out, cfg, mesh, bias=True)
        layout = LAYOUTS[cls.kind]
        for name, placement, got, want in (
            ("weight", layout.weight, layer.weight, ref.weight),
            ("bias", layout.bias, layer.bias, ref.bias),
            ("lora_A", layout.lora_A, layer.lora_A.weight, ref.lora_A.weight),
            ("lora_B", layout.lora_B, layer.lora_B.weight, ref.lora_B.weight),
        ):
            assert got.placements == (placement,), f"{cls.kind} {name}: {got.placements}"
            assert torch.equal(got.full_tensor(), want), f"{cls.kind} {name} differs from the seeded LoRALinear"
        assert not layer.lora_B.weight.to_local().any(), "B must start at zero"
        replicated = getattr(layer, LAYOUTS[cls.kind].replicated_factor).weight
        _dist.assert_same_on_all_ranks(replicated.to_local(), f"{cls.kind} replicated factor")

        # from_linear: rank 0's nn.Linear is the source; A is drawn from the global shape as LoRALinear does.
        torch.manual_seed(seed)
        ref = LoRALinear.from_linear(nn.Linear(fan_in, fan_out), cfg)
        torch.manual_seed(seed + rank)
        layer = cls.from_linear(nn.Linear(fan_in, fan_out), cfg, mesh)
        for name in ("weight", "bias", "lora_A.weight", "lora_B.weight"):
            got, want = layer.get_parameter(name), ref.get_parameter(name)
            assert torch.equal(got.full_tensor(), want), f"{cls.kind}.from_linear {name} differs"
        assert not layer.weight.requires_grad and layer.lora_A.weight.requires_grad


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_init_is_independent_of_tp_size_and_comes_from_rank_0(world_size):
    _dist.run_ranks(world_size, _init_independent_of_tp, 7)


def _meta_built_layers_initialise_like_constructed_ones(seed: int) -> None:
    """torchtitan's flow: build on the meta device, ``to_empty()``, then ``reset_parameters()``. The full tensors
    must be the constructor's (so independent of the TP size), and rank 0's draw whatever the other ranks'
    generators; the ranks of a tp group share the dropout seeds' offset."""
    mesh, rank, device = _dist.mesh(), dist.get_rank(), _dist.device()
    cfg = _config(dropout=0.25)
    for cls, (fan_in, fan_out) in ((ColumnParallelLoRALinear, (K, H)), (RowParallelLoRALinear, (H, N))):
        torch.manual_seed(seed)
        ref = LoRALinear(fan_in, fan_out, cfg, bias=True, device=device)
        with torch.device("meta"):
            in_context = cls(fan_in, fan_out, cfg, mesh, bias=True)
            sharded_in_place = cls.from_lora_linear(LoRALinear(fan_in, fan_out, cfg, bias=True), mesh)
        built = {
            "device context": in_context,
            "device='meta'": cls(fan_in, fan_out, cfg, mesh, bias=True, device="meta"),
            "from_lora_linear": sharded_in_place,
        }
        for how, layer in built.items():
            what = f"{cls.kind} built with {how}"
            assert all(isinstance(p, DTensor) and p.is_meta for p in layer.parameters()), what
            width = fan_in // (mesh.size() if cls.kind == "row" else 1)
            with pytest.raises(RuntimeError, match=r"on the meta device; materialize them first with to_empty"):
                layer(torch.randn(BATCH, SEQ, width, device=device))
            layer.to_empty(device=device)
            torch.manual_seed(seed + rank)  # rank 0's draw must win
            reset_every_module(layer)  # the usual recipe: the layer's reset, then its factors' (which draw nothing)
            for name in ("weight", "bias", "lora_A.weight", "lora_B.weight"):
                got = layer.get_parameter(name)
                assert got.placements == (getattr(LAYOUTS[cls.kind], name.split(".")[0]),), f"{what}: {name}"
                assert torch.equal(got.full_tensor(), ref.get_parameter(name)), f"{what}: {name} differs"
            assert layer.lora_A.weight.requires_grad and not layer.weight.requires_grad, what
            offset = torch.tensor([layer._dropout_stream.offset], device=device)
            _dist.assert_same_on_all_ranks(offset, f"{what}: dropout seed offset")
            # It runs like the constructed layer: the same output and adapter gradients.
            torch.manual_seed(seed)
            constructed = cls(fan_in, fan_out, cfg, mesh, bias=True)
            x = torch.randn(BATCH, SEQ, width, device=device)
            results = []
            for m in (layer, constructed):
                with torch.no_grad():
                    m.lora_B.weight.to_local().fill_(0.5)  # B = 0 would hide the LoRA path
                y = m.eval()(x)
                y.square().sum().backward()
                results.append([y, m.lora_A.weight.grad.to_local(), m.lora_B.weight.grad.to_local()])
            for got, want, name in zip(*results, ("y", "dA", "dB"), strict=True):
                assert torch.equal(got, want), f"{what}: {name}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layers_built_on_the_meta_device_initialise_like_constructed_ones(world_size):
    _dist.run_ranks(world_size, _meta_built_layers_initialise_like_constructed_ones, 7)


def _recording(make_dropout, used: list):
    """Wrap a layer's ``_dropout(x, k_offset)`` so every ``Dropout`` (or ``None``) it returns is recorded."""

    def wrapped(x: torch.Tensor, k_offset: int):
        used.append(make_dropout(x, k_offset))
        return used[-1]

    return wrapped


def _dropout_matches_reference(sp: bool, position: str) -> None:
    p = 0.4
    col, row, col_ref, row_ref = _tp_pair(F32, sp, dropout=p)
    tp, rank = dist.get_world_size(), dist.get_rank()
    for layer, ref, kind in ((col, col_ref, "column"), (row, row_ref, "row")):
        # "post" masks x A^T [M, r]: whole on every column rank, a partial sum on each row rank (the same
        # mask on every rank, so masking the partials masks their sum).
        layer.config = dataclasses.replace(layer.config, dropout_position=position)
        layer.train()
        used: list[Dropout | None] = []
        layer._dropout = _recording(layer._dropout, used)
        seeds = []
        for call in range(2):
            fan_in = layer.in_features
            x_full = torch.randn(BATCH, SEQ, fan_in)
            dy_full = torch.randn(BATCH, SEQ, layer.out_features)
            if kind == "column":
                x, dy = _seq_shard(x_full, sp), dy_full.chunk(tp, dim=-1)[rank]
            else:
                x, dy = x_full.chunk(tp, dim=-1)[rank], _seq_shard(dy_full, sp)
            x = x.clone().requires_grad_(True)
            layer.zero_grad()
            y = layer(x)
            y.backward(dy)
            d = used[-1]
            want_offset = rank * (fan_in // tp) if kind == "row" else 0
            assert d.k_offset == want_offset, f"{kind}: k_offset {d.k_offset} != {want_offset}"
            seeds.append(int(d.seed))
            full_mask = Dropout(p=d.p, seed=d.seed, position=d.position, k_offset=0)
            r = lora_reference(
                x_full, ref.weight, ref.bias, ref.lora_A.weight, ref.lora_B.weight, layer.scale, dy_full,
                dropout=full_mask,
            )
            if kind == "column":
                y_ref, dx_ref = r.y.chunk(tp, dim=-1)[rank], _seq_shard(r.dx, sp)
            else:
                y_ref, dx_ref = _seq_shard(r.y, sp), r.dx.chunk(tp, dim=-1)[rank]
            _close(y, y_ref, F32, f"{kind} call {call}: y")
            _close(x.grad, dx_ref, F32, f"{kind} call {call}: x.grad")
            _close(layer.lora_A.weight.grad.full_tensor(), r.dA, F32, f"{kind} call {call}: dA")
            _close(layer.lora_B.weight.grad.full_tensor(), r.dB, F32, f"{kind} call {call}: dB")
            assert d.position == position, f"{kind}: dropout position {d.position}"
            if kind == "row" and rank > 0 and position == "pre":  # the check can fail: not the un-offset mask
                shape = (BATCH * SEQ, fan_in // tp, "cpu")
                assert not torch.equal(keep_mask(d, *shape), keep_mask(full_mask, *shape))
        assert seeds[0] != seeds[1], f"{kind}: two forwards reused one dropout seed"
        assert len(set(map(tuple, _dist.all_gather_object(seeds)))) == 1, f"{kind}: ranks disagree on seeds"
        layer.eval()
        used.clear()
        layer(x)
        assert used == [None], "eval mode must not drop"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("position", ["pre", "post"])
@SP
def test_dropout_masks_are_slices_of_the_single_device_mask(world_size, position, sp):
    _dist.run_ranks(world_size, _dropout_matches_reference, sp, position)


def _dropout_seeds_follow_the_generators() -> None:
    """Dropout seeds come from each rank's default generator: the tp ranks of a group, seeded alike, draw one mask;
    data-parallel replicas (other tp groups) draw apart; restoring the generator replays the seeds (so a resumed run,
    whose ranks get their saved RNG states back, draws the uninterrupted run's masks). A state dict from when the
    layers kept a dropout stream (``[seed, step]`` as ``_extra_state``) still loads strictly, the stream ignored."""
    mesh = _dist.mesh((2, 2), ("dp", "tp"))["tp"]
    torch.manual_seed(1)
    layer = ColumnParallelLoRALinear(K, H, LoRAConfig(r=R, alpha=6, dropout=0.3), mesh).train()
    x = torch.randn(BATCH, SEQ, K)
    used: list[Dropout | None] = []
    layer._dropout = _recording(layer._dropout, used)

    def next_seed() -> int:
        layer(x)
        return int(used[-1].seed)

    state = torch.get_rng_state()
    seeds = [next_seed(), next_seed()]
    assert seeds[0] != seeds[1], "two forwards reused one dropout seed"
    torch.set_rng_state(state)
    assert next_seed() == seeds[0], "the restored generator drew another seed"
    everyone = _dist.all_gather_object(seeds)  # global ranks (0, 1) and (2, 3) form the tp groups
    assert everyone[0] == everyone[1] and everyone[2] == everyone[3], f"tp ranks disagree on the seeds: {everyone}"
    assert everyone[0][0] != everyone[2][0], f"data-parallel replicas share dropout masks: {everyone}"
    # The requirement the docs state: ranks whose generators differ draw different masks.
    torch.manual_seed(2 + dist.get_rank())
    alone = _dist.all_gather_object(next_seed())
    assert alone[0] != alone[1], alone

    del layer._dropout
    state_dict = layer.state_dict()
    assert not [k for k in state_dict if k.endswith("_extra_state")], list(state_dict)
    loaded = layer.load_state_dict({**state_dict, "_extra_state": torch.tensor([12345, 3])})
    assert loaded.missing_keys == [] and loaded.unexpected_keys == [], loaded
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"extra\""):
        layer.load_state_dict({**state_dict, "extra": torch.tensor([12345, 3])})


def test_dropout_seeds_agree_across_tp_ranks_differ_across_replicas_and_replay_from_the_generator():
    _dist.run_ranks(4, _dropout_seeds_follow_the_generators)


def _save_matmuls_context():
    """Selective activation checkpointing like torchtitan's op-level policy: keep matmul outputs, recompute the rest."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _save_dropout_seeds_context():
    """Selective activation checkpointing that saves the layers' dropout seeds (8 bytes a call) and recomputes the
    rest: on the CPU, torch 2.13's AOTAutograd cannot recompute a random op in a region whose graph also returns
    DTensor gradients (it places the replayed generator state among the saved tensors, after the saved mesh)."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is torch.ops.parallel_lora.dropout_seed.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _rng_state() -> torch.Tensor:
    """The state of the generator the dropout seeds come from (on CUDA, eager calls also draw CPU tags; compiled
    ones do not)."""
    return torch.cuda.get_rng_state() if _dist.device_type() == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    (torch.cuda.set_rng_state if _dist.device_type() == "cuda" else torch.set_rng_state)(state)


def _mlp_step_matches_eager(region: str, sp: bool) -> None:
    """One dropout step of ``row(gelu(col(x)))`` run through ``region`` gives the plain eager step's output and
    gradients bit for bit, given the same forward seeds."""
    col, row, _, _ = _tp_pair(F32, sp, dropout=0.4)
    for m in (col, row):
        m.train()
    tp, rank, device = dist.get_world_size(), dist.get_rank(), _dist.device()
    x_full = _seq_shard(torch.randn(BATCH, SEQ, K, device=device), sp)
    dy = _seq_shard(torch.randn(BATCH, SEQ, N, device=device), sp)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return row(F.gelu(col(x)))

    def compiled(context_fn=noop_context_fn):
        run = lambda x: checkpoint(mlp, x, use_reentrant=False, context_fn=context_fn)  # noqa: E731
        return torch.compile(run, fullgraph=True, backend="aot_eager")

    # Reruns and recomputes must draw the forward's masks.
    regions = {
        "checkpoint": lambda x: checkpoint(mlp, x, use_reentrant=False),
        "reentrant checkpoint": lambda x: checkpoint(mlp, x, use_reentrant=True),
        "selective checkpoint": lambda x: checkpoint(mlp, x, use_reentrant=False, context_fn=_save_matmuls_context),
        "torch.compile of a checkpoint": compiled(),
        "torch.compile of a checkpoint saving the seeds": compiled(_save_dropout_seeds_context),
    }

    def step(run) -> list[torch.Tensor]:
        for m in (col, row):
            m.zero_grad(set_to_none=True)
        x = x_full.clone().requires_grad_(True)
        y = run(x)
        y.backward(dy)
        return [y.detach(), x.grad, *(_full(p.grad) for _, p in _adapters(col, row))]

    # Two steps each: a compiled graph that baked in one call's seed would reuse its masks in the next.
    rng = _rng_state()
    want = [step(mlp), step(mlp)]
    after = _rng_state()
    _set_rng_state(rng)  # the same forward seeds again
    got = [step(regions[region]), step(regions[region])]
    names = ["y", "x.grad", *(n for n, _ in _adapters(col, row))]
    for i in range(2):
        for name, g, w in zip(names, got[i], want[i], strict=True):
            assert torch.equal(g, w), f"tp={tp} rank {rank}: step {i}: {name} differs under {region}"
    assert torch.equal(_rng_state(), after), f"{region} drew other random numbers than the plain steps"
    # The check can fail: the second step draws other masks, and its adapter gradients differ.
    assert not torch.equal(want[0][-1], want[1][-1])


@pytest.mark.parametrize("region", ["checkpoint", "reentrant checkpoint", "selective checkpoint"])
@SP
def test_activation_checkpointing_reruns_the_forward_dropout_masks(region, sp):
    _dist.run_ranks(2, _mlp_step_matches_eager, region, sp)


@SP
def test_torch_compile_of_a_selective_checkpoint_saving_the_seeds_reruns_the_forward_dropout_masks(sp):
    _dist.run_ranks(2, _mlp_step_matches_eager, "torch.compile of a checkpoint saving the seeds", sp)


@pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="torch 2.13 on the CPU: AOTAutograd saves the replayed generator state after the DTensor gradients' mesh",
)  # fmt: skip
def test_torch_compile_of_a_checkpoint_with_dropout_fails_on_the_cpu_in_torch():
    # When this passes, torch has fixed it: drop the seed-saving policy from the CPU tests and the docs' note.
    _dist.run_ranks(2, _mlp_step_matches_eager, "torch.compile of a checkpoint", False)


# ------------------------------------------------------------------------------------------ bad input
def _bad_inputs_raise() -> None:
    mesh, tp = _dist.mesh(), dist.get_world_size()
    assert tp == 2
    cfg = _config()
    with pytest.raises(ValueError, match=r"out_features=5 must be divisible by the tensor-parallel size 2"):
        ColumnParallelLoRALinear(K, 5, cfg, mesh)
    with pytest.raises(ValueError, match=r"in_features=5 must be divisible by the tensor-parallel size 2"):
        RowParallelLoRALinear(5, N, cfg, mesh)
    with pytest.raises(ValueError, match=r"out_features=5 must be divisible"):
        ColumnParallelLoRALinear.from_linear(nn.Linear(K, 5), cfg, mesh)
    with pytest.raises(ValueError, match=r"1-D mesh, got a 2-D mesh of shape \(1, 2\).*mesh\['tp'\]"):
        ColumnParallelLoRALinear(K, H, cfg, _dist.mesh((1, 2), ("dp", "tp")))
    with pytest.raises(TypeError, match="DeviceMesh"):
        RowParallelLoRALinear(H, N, cfg, dist.group.WORLD)
    # "cuda" is rejected before anything is allocated: no GPU needed. ("meta" is accepted: see the meta test.)
    msg = r"module device cuda.* does not match the mesh's device type 'cpu' \(or 'meta'"
    with pytest.raises(ValueError, match=msg):
        ColumnParallelLoRALinear(K, H, cfg, mesh, device="cuda")

    col = ColumnParallelLoRALinear(K, H, cfg, mesh)
    row = RowParallelLoRALinear(H, N, cfg, mesh)
    with pytest.raises(ValueError, match=r"expected input of last dimension 16 .*got shape \(2, 8, 12\)"):
        col(torch.randn(BATCH, SEQ, H // 2))
    with pytest.raises(ValueError, match=r"expected input of last dimension 12 \(in_features/tp = 24/2"):
        row(torch.randn(BATCH, SEQ, H))  # the full width is wrong for a row shard
    with pytest.raises(ValueError, match="input on meta"):
        col(torch.randn(BATCH, SEQ, K, device="meta"))
    with pytest.raises(TypeError, match="plain local torch.Tensor, got DTensor"):
        col(torch.distributed.tensor.distribute_tensor(torch.randn(BATCH, SEQ, K), mesh, [Replicate()]))
    row_sp = RowParallelLoRALinear(H, N, cfg, mesh, sequence_parallel=True)
    msg = r"sequence length 7 \(dim 1\) must be divisible by the tensor-parallel size 2"
    with pytest.raises(ValueError, match=msg):
        row_sp(torch.randn(BATCH, 7, H // 2))
    col_sp = ColumnParallelLoRALinear(K, H, cfg, mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel needs x with at least 2 dims"):
        col_sp(torch.randn(K))


@pytest.mark.parametrize("world_size", [2])
def test_bad_shapes_meshes_and_devices_raise_errors_naming_the_numbers(world_size):
    _dist.run_ranks(world_size, _bad_inputs_raise)


# ----------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("world_size", [1, 2])
@SP
def test_gpu_nccl_triton_bf16_mlp_matches_single_device_fp64(world_size, sp):
    """NCCL, one GPU per rank, ``backend="auto"`` (the fused Triton kernels on CUDA), bf16 base."""
    _dist.run_ranks(world_size, _mlp_matches_reference, BF16, sp, backend="nccl")


@gpu
@SP
def test_gpu_nccl_torch_compile_of_a_checkpointed_tp_mlp_reruns_the_forward_dropout_masks(sp):
    """On CUDA, AOTAutograd replays the seed draw from graph-safe generator states: plain checkpointing works."""
    _dist.run_ranks(2, _mlp_step_matches_eager, "torch.compile of a checkpoint", sp, backend="nccl")


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_nccl_activation_collectives_run_in_bf16(world_size):
    _dist.run_ranks(world_size, _collective_dtypes, BF16, True, backend="nccl")


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_nccl_layers_built_on_the_meta_device_initialise_like_constructed_ones(world_size):
    """The seed is drawn on the current CUDA device at construction; the resets draw on it too."""
    _dist.run_ranks(world_size, _meta_built_layers_initialise_like_constructed_ones, 7, backend="nccl")
