"""``ColwiseParallelLoRA`` / ``RowwiseParallelLoRA`` / ``lora_plan`` in ``parallelize_module`` (2 ranks, gloo).

Reference: the same model after ``apply_lora`` (random non-zero ``B``), deep-copied *before* it is
parallelized and run unparallelized on one device in fp32: outputs, input gradients and every adapter
gradient (``.full_tensor()``) must match. The model is a pre-norm transformer block, attention
``q/k/v/o_proj`` (heads split across ranks) and a SwiGLU MLP ``gate/up/down_proj``.

Tolerance (fp32 only): ``atol = 1e-5 * max|ref|``, ``rtol = 1e-5``: fp32 throughout; the parallel model
differs only in summation order (dots split over ranks and re-summed by one all-reduce / reduce-scatter),
amplified at most a few times by softmax and layer norm. The plain-``nn.Linear`` and mapping checks are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallel_lora import (
    ColumnParallelLoRALinear,
    ColwiseParallelLoRA,
    LoRAConfig,
    RowParallelLoRALinear,
    RowwiseParallelLoRA,
    apply_lora,
    lora_plan,
)
from tests import _dist

D, HEAD_DIM, HIDDEN = 16, 4, 32  # 4 heads: 2 per rank
BATCH, SEQ = 2, 8
ATOL, RTOL = 1e-5, 1e-5
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORLD = 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.o_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the full model has 4, a column-parallel shard its local 4/tp.
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, HIDDEN), nn.Linear(D, HIDDEN)
        self.down_proj = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attn = nn.LayerNorm(D), Attention()
        self.ffn_norm, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


def _lora_block(targets: tuple[str, ...]) -> tuple[Block, Block]:
    """(model to parallelize, unparallelized reference): identical on every rank."""
    torch.manual_seed(99)
    model = apply_lora(Block(), LoRAConfig(r=3, alpha=6, target_modules=targets), verbose=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # B = 0 would hide the LoRA path
    return model, copy.deepcopy(model)


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got = got.full_tensor() if isinstance(got, DTensor) else got
    assert got.shape == ref.shape, f"{what}: {tuple(got.shape)} != {tuple(ref.shape)}"
    torch.testing.assert_close(got, ref, atol=ATOL * ref.abs().max().item(), rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _check_against_reference(model: nn.Module, ref: nn.Module, sp: bool) -> None:
    tp, rank = dist.get_world_size(), dist.get_rank()
    x_full, dy_full = torch.randn(BATCH, SEQ, D), torch.randn(BATCH, SEQ, D)
    shard = (lambda t: t.chunk(tp, dim=1)[rank]) if sp else (lambda t: t)
    x = shard(x_full).clone().requires_grad_(True)
    y = model(x)
    y = y.to_local() if isinstance(y, DTensor) else y
    y.backward(shard(dy_full))
    x_ref = x_full.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy_full)
    _close(y, shard(y_ref), "output")
    _close(x.grad, shard(x_ref.grad), "x.grad")
    ref_params = dict(ref.named_parameters())
    n_adapters = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            n_adapters += 1
            assert "lora_" in name, f"{name} is trainable: the base must stay frozen"
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            _close(p.grad, ref_params[name].grad, f"{name}.grad")
    assert n_adapters == 2 * len(model.lora_summary["modules"])


def _kinds(model: nn.Module) -> dict[str, str]:
    return {
        n.rsplit(".", 1)[-1]: type(m).__name__
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) or "LoRALinear" in type(m).__name__
    }


# ---------------------------------------------------------------------------------------- plans of our styles
def _our_styles_match_reference() -> None:
    mesh = _dist.mesh()
    model, ref = _lora_block(ALL)
    colwise, rowwise = ColwiseParallelLoRA(), RowwiseParallelLoRA()
    plan = {f"attn.{p}_proj": colwise for p in "qkv"} | {"attn.o_proj": rowwise}
    plan |= {"mlp.gate_proj": colwise, "mlp.up_proj": colwise, "mlp.down_proj": rowwise}
    parallelize_module(model, mesh, plan)
    kinds = _kinds(model)
    assert {kinds[p] for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")} == {"ColumnParallelLoRALinear"}
    assert {kinds[p] for p in ("o_proj", "down_proj")} == {"RowParallelLoRALinear"}, kinds
    _check_against_reference(model, ref, sp=False)

    # DTensor in and out: use_local_output=False hands a Shard(-1) DTensor to the next layer, whose pre-hook
    # takes its local shard; the row output comes back as a Replicate DTensor.
    torch.manual_seed(5)
    seq = apply_lora(nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D)),
                     LoRAConfig(r=3, target_modules="all-linear"), verbose=False)
    seq_ref = copy.deepcopy(seq)
    parallelize_module(seq, mesh, {"0": ColwiseParallelLoRA(use_local_output=False),
                                   "2": RowwiseParallelLoRA(use_local_output=False)})
    x = torch.randn(BATCH, SEQ, D)
    hidden = seq[0](x)
    assert isinstance(hidden, DTensor) and hidden.placements[0].is_shard(), hidden.placements
    y = seq(x)
    assert isinstance(y, DTensor) and y.placements == (Replicate(),), type(y)
    _close(y, seq_ref(x), "use_local_output=False output")


def test_plan_of_lora_styles_matches_the_unparallelized_model():
    _dist.run_ranks(WORLD, _our_styles_match_reference)


def _plain_linear_raises() -> None:
    mesh = _dist.mesh()
    model, _ = _lora_block(("q_proj",))
    for style in (ColwiseParallelLoRA(), RowwiseParallelLoRA()):
        with pytest.raises(TypeError, match=r"applies to LoRALinear modules \(run apply_lora first\), got Linear"):
            parallelize_module(model, mesh, {"attn.k_proj": style})
    assert type(model.attn.k_proj) is nn.Linear and not isinstance(model.attn.k_proj.weight, DTensor)


def test_lora_style_on_a_plain_linear_without_fallback_raises_type_error():
    _dist.run_ranks(WORLD, _plain_linear_raises)


# ------------------------------------------------------------------------------------------- torch plans
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")  # up_proj stays plain


def _torch_plan(sp: bool) -> dict:
    if not sp:
        colwise, rowwise = ColwiseParallel(), RowwiseParallel()
        plan = {}
    else:
        colwise, rowwise = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    plan |= {f"attn.{p}_proj": colwise for p in "qkv"} | {"attn.o_proj": rowwise}
    return plan | {"mlp.gate_proj": colwise, "mlp.up_proj": colwise, "mlp.down_proj": rowwise}


def _lora_plan_matches_reference(sp: bool) -> None:
    mesh = _dist.mesh()
    model, ref = _lora_block(TARGETS)
    parallelize_module(model, mesh, lora_plan(_torch_plan(sp)))
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
        layer = model.get_submodule(f"{'mlp' if name == 'gate_proj' else 'attn'}.{name}")
        assert type(layer) is ColumnParallelLoRALinear and layer.sequence_parallel == sp, name
    for layer in (model.attn.o_proj, model.mlp.down_proj):
        assert type(layer) is RowParallelLoRALinear and layer.sequence_parallel == sp
    up = model.mlp.up_proj  # not adapted: torch's ColwiseParallel, through the fallback
    assert type(up) is nn.Linear and isinstance(up.weight, DTensor) and up.weight.placements == (Shard(0),)
    assert not up.weight.requires_grad
    if sp:
        assert isinstance(model.attention_norm.weight, DTensor)  # SequenceParallel applied
        # torch's SequenceParallel re-registers norm parameters as fresh nn.Parameters (requires_grad=True);
        # lora_plan keeps apply_lora's freezing.
        for p in (*model.attention_norm.parameters(), *model.ffn_norm.parameters()):
            assert not p.requires_grad
    _check_against_reference(model, ref, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_lora_plan_of_a_torch_plan_matches_and_keeps_torch_style_for_unadapted_linears(sp):
    _dist.run_ranks(WORLD, _lora_plan_matches_reference, sp)


def _gathered_plan_matches_reference(sp: bool) -> None:
    """A torch plan whose column layers gather their outputs (``output_layouts=Replicate()``) and whose row
    layers take whole inputs (``input_layouts=Replicate()``): every rank runs the attention and the SwiGLU
    product on whole tensors, and each layer's output is what the torch style would hand over."""
    mesh = _dist.mesh()
    model, ref = _lora_block(TARGETS)
    seq_in, seq_out = (Shard(1), Shard(1)) if sp else (None, None)
    colwise = ColwiseParallel(input_layouts=seq_in, output_layouts=Replicate())
    rowwise = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out)
    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()} if sp else {}
    plan |= {f"attn.{p}_proj": colwise for p in "qkv"} | {"attn.o_proj": rowwise}
    plan |= {"mlp.gate_proj": colwise, "mlp.up_proj": colwise, "mlp.down_proj": rowwise}
    mapped = lora_plan(plan)
    assert mapped["attn.q_proj"].gather_output and not mapped["attn.o_proj"].input_is_parallel
    parallelize_module(model, mesh, mapped)
    assert type(model.attn.q_proj) is ColumnParallelLoRALinear and type(model.attn.o_proj) is RowParallelLoRALinear
    x = torch.randn(BATCH, SEQ // (WORLD if sp else 1), D)
    assert model.attn.q_proj(model.attention_norm(x)).shape[-1] == D, "the column output is not gathered"
    _check_against_reference(model, ref, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_lora_plan_honours_gathered_column_outputs_and_replicated_row_inputs(sp):
    _dist.run_ranks(WORLD, _gathered_plan_matches_reference, sp)


def _unsupported_layout_is_refused_on_lora_layers_only() -> None:
    mesh = _dist.mesh()
    model, _ = _lora_block(("q_proj",))
    odd = ColwiseParallel(output_layouts=Shard(1))  # a sequence-sharded output: no LoRA layer makes it
    parallelize_module(model, mesh, lora_plan({"attn.k_proj": odd}))  # a plain linear: torch's style applies
    assert isinstance(model.attn.k_proj.weight, DTensor)
    with pytest.raises(ValueError, match=r"'attn.q_proj': ColwiseParallel\(.*output_layouts=S\(1\)\).*Shard\(-1\)"):
        parallelize_module(model, mesh, lora_plan({"attn.q_proj": odd}))


def test_lora_plan_refuses_a_layout_the_lora_layers_cannot_produce():
    _dist.run_ranks(WORLD, _unsupported_layout_is_refused_on_lora_layers_only)


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "reset_lora_parameters")]


def _meta_built_plan_loads_a_full_state_dict(sp: bool) -> None:
    """torchtitan's flow (docs/tensor_parallel.md): the model and its adapters built on the meta device,
    parallelized there, materialized with ``to_empty()``, the pretrained base loaded through torch.distributed's
    ``set_model_state_dict``, fresh adapters from ``reset_lora_parameters()``. The adapters must be the ones
    the same resets give the unparallelized model; with its full state dict loaded, it must run like it."""
    mesh = _dist.mesh()
    _, ref = _lora_block(TARGETS)
    with torch.device("meta"):
        model = apply_lora(Block(), LoRAConfig(r=3, alpha=6, target_modules=TARGETS), verbose=False)
    parallelize_module(model, mesh, lora_plan(_torch_plan(sp)))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=_dist.device())
    base = {k: v for k, v in ref.state_dict().items() if "lora_" not in k}
    set_model_state_dict(model, base, options=StateDictOptions(full_state_dict=True, strict=False))
    fresh = copy.deepcopy(ref)
    for m in (model, fresh):
        torch.manual_seed(11)
        for layer in _lora_layers(m):
            layer.reset_lora_parameters()
    want = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.equal(got, want[name].detach()), f"{name} differs from the unparallelized model's"
    assert len(_lora_layers(model)) == len(TARGETS)

    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    assert type(model.attn.q_proj) is ColumnParallelLoRALinear and type(model.mlp.down_proj) is RowParallelLoRALinear
    _check_against_reference(model, ref, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_a_plan_applied_on_the_meta_device_runs_after_to_empty_and_a_full_state_dict(sp):
    _dist.run_ranks(WORLD, _meta_built_plan_loads_a_full_state_dict, sp)


def test_lora_plan_maps_torch_styles_and_reads_sequence_parallel_from_layouts():
    """In-process: the mapping alone needs no process group."""
    norm, col = SequenceParallel(), ColwiseParallel(input_layouts=Shard(1))
    row = RowwiseParallel(output_layouts=Shard(1))
    plain_col, plain_row = ColwiseParallel(use_local_output=False), RowwiseParallel()
    mapped = lora_plan({"norm": norm, "q": col, "o": row, "up": plain_col, "down": plain_row})
    assert mapped["norm"].style is norm
    for key, cls, sp, fallback in (
        ("q", ColwiseParallelLoRA, True, col),
        ("o", RowwiseParallelLoRA, True, row),
        ("up", ColwiseParallelLoRA, False, plain_col),
        ("down", RowwiseParallelLoRA, False, plain_row),
    ):
        style = mapped[key]
        assert type(style) is cls and style.sequence_parallel is sp and style.fallback is fallback, (key, style)
        assert style.sequence_dim == 1
    assert mapped["up"].use_local_output is False and mapped["down"].use_local_output is True
