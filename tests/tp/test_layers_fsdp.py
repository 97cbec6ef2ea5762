"""FSDP2 (``fully_shard`` over ``dp``) on top of the tensor-parallel LoRA layers (``tp``): a 2 x 2 mesh, gloo.

Reference: the same column -> gelu -> row ``LoRALinear`` pair on one device in float64, from the same full
tensors, trained by AdamW on the loss averaged over both data-parallel batches (what FSDP's averaging
reduce-scatter of the per-rank gradients computes), with the same ``clip_grad_norm_``. Checked per step:
each rank's loss, every adapter gradient (``.full_tensor()`` over both mesh dims) and the total gradient
norm; after training: adapter weights, and the frozen base bitwise unchanged.

Built on the meta device instead (torchtitan's order), the same models, and single-device ``LoRALinear``s under
FSDP2 alone, must hold the constructor's values after ``to_empty()`` and the per-module resets. And the whole
torchtitan recipe at once (meta, ``lora_plan`` with SP, selective activation checkpointing, ``torch.compile`` with
``fullgraph=True``, FSDP2, a full state dict, dropout) must train bit for bit like the same model built plainly, and
resume from its own state dicts through DCP (torchtitan's checkpointing) like the uninterrupted run. Adapter files
hold the full tensors under FSDP2 x TP, and load back into both meshes' shards.

Tolerance (fp32 only): ``atol = 1e-5 * max|ref|``, ``rtol = 1e-5``: fp32 throughout; the distributed run
differs only in summation order (tp partial sums, the dp average). Frozen weights are compared exactly.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallel_lora import (
    ColumnParallelLoRALinear,
    LoRAConfig,
    LoRALinear,
    RowParallelLoRALinear,
    apply_lora,
    load_adapter,
    lora_plan,
    merge_lora,
    save_adapter,
    unmerge_lora,
)
from tests import _dist
from tests._recipes import reset_every_module

F64 = torch.float64
K, H, N, R = 16, 24, 16, 3
BATCH, SEQ = 2, 8
DP, TP = 2, 2
ATOL, RTOL = 1e-5, 1e-5


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(
        got.to(F64), ref.detach().to(F64), atol=ATOL * ref.abs().max().item(), rtol=RTOL, msg=lambda m: f"{what}: {m}"
    )


def _fsdp_tp_training(steps: int = 2) -> None:
    mesh = _dist.mesh((DP, TP), ("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    cfg = LoRAConfig(r=R, alpha=6, backend="auto")
    torch.manual_seed(1234)
    col, row = LoRALinear(K, H, cfg, bias=True), LoRALinear(H, N, cfg, bias=True)
    with torch.no_grad():
        for m in (col, row):
            m.lora_B.weight.normal_(0.0, 0.5)  # B = 0 would hide the LoRA path
            m.bias.normal_()
    ref = nn.Sequential(copy.deepcopy(col), nn.GELU(), copy.deepcopy(row)).to(F64)
    model = nn.Sequential(
        ColumnParallelLoRALinear.from_lora_linear(col, mesh["tp"]),
        nn.GELU(),
        RowParallelLoRALinear.from_lora_linear(row, mesh["tp"]),
    )
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert sorted(trainable) == sorted(n for n, _ in ref.named_parameters() if "lora_" in n), sorted(trainable)
    assert len(frozen) == 4, sorted(frozen)  # both weights and biases
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), (name, p.device_mesh)
    initial = {n: p.full_tensor().clone() for n, p in trainable.items()}
    ref_trainable = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    opt = torch.optim.AdamW(trainable.values(), lr=2e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref_trainable.values(), lr=2e-2, weight_decay=0.1)
    max_norm = 0.05

    for step in range(steps):
        x_all, t_all = torch.randn(DP, BATCH, SEQ, K), torch.randn(DP, BATCH, SEQ, N)  # same on every rank
        loss = (model(x_all[dp_rank]) - t_all[dp_rank]).square().mean()
        loss.backward()
        per_batch_ref = (ref(x_all.to(F64)) - t_all.to(F64)).square().mean(dim=(1, 2, 3))
        per_batch_ref.mean().backward()
        _close(loss.detach(), per_batch_ref[dp_rank], f"step {step}: loss of dp batch {dp_rank}")
        for name, p in trainable.items():
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            _close(p.grad, ref_trainable[name].grad, f"step {step}: {name}.grad")
        for name, p in model.named_parameters():
            assert p.requires_grad or p.grad is None, f"frozen {name} got a gradient"
        norm = torch.nn.utils.clip_grad_norm_(list(trainable.values()), max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(list(ref_trainable.values()), max_norm)
        assert norm_ref > max_norm, "clipping is not exercised"
        _close(norm, norm_ref, f"step {step}: grad norm")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()

    for name, p in trainable.items():
        _close(p, ref_trainable[name], f"{name} after {steps} steps")
        assert not torch.equal(p.full_tensor(), initial[name]), f"{name} was not updated"
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.full_tensor(), frozen[name]), f"frozen {name} changed"
    assert dist.get_world_size() == DP * TP


def test_fsdp2_over_dp_with_lora_tp_layers_trains_like_single_device_fp64():
    _dist.run_ranks(DP * TP, _fsdp_tp_training)


def _mlp(mesh, seed: int) -> nn.Sequential:
    """Column -> gelu -> row on ``mesh['tp']`` (single-device ``LoRALinear``s when the mesh has no tp dim),
    each layer built right after ``manual_seed(seed + i)``."""
    cfg = LoRAConfig(r=R, alpha=6)
    layers = []
    for i, (cls, fan_in, fan_out) in enumerate(((ColumnParallelLoRALinear, K, H), (RowParallelLoRALinear, H, N))):
        torch.manual_seed(seed + i)
        if "tp" in mesh.mesh_dim_names:
            layers.append(cls(fan_in, fan_out, cfg, mesh["tp"], bias=True))
        else:
            layers.append(LoRALinear(fan_in, fan_out, cfg, bias=True))
    return nn.Sequential(layers[0], nn.GELU(), layers[1])


def _fully_shard(model: nn.Sequential, mesh) -> nn.Sequential:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _meta_init_under_fsdp(seed: int, tp: bool) -> None:
    """torchtitan's order: build on meta, tensor-parallel layers (if ``tp``), ``fully_shard``, ``to_empty()``,
    then ``reset_parameters()`` on every module of each layer (the usual recipe; every rank seeded differently).
    FSDP2 shards TP-sharded dims again (``_StridedShard``); the reset must still leave the constructor's full
    tensors (rank 0's draw), and one step must match the constructed model's bit for bit."""
    mesh = _dist.mesh((DP, TP), ("dp", "tp")) if tp else _dist.mesh((DP,), ("dp",))
    constructed = _fully_shard(_mlp(mesh, seed), mesh)
    with torch.device("meta"):
        model = _fully_shard(_mlp(mesh, seed), mesh)
    model.to_empty(device=_dist.device())
    for i, layer in enumerate((model[0], model[2])):
        torch.manual_seed(seed + i + 100 * dist.get_rank())  # rank 0's draw must win
        reset_every_module(layer)  # the layer's reset, then its factors' (which draw nothing)
    want = dict(constructed.named_parameters())
    for name, p in model.named_parameters():
        assert p.device_mesh.mesh_dim_names == mesh.mesh_dim_names and p.placements == want[name].placements, name
        assert torch.equal(p.full_tensor(), want[name].full_tensor()), f"{name} differs from the constructed model"

    x = torch.randn(BATCH, SEQ, K)
    grads = []
    for m in (model, constructed):
        with torch.no_grad():
            for layer in (m[0], m[2]):
                layer.lora_B.weight.to_local().fill_(0.5)  # B = 0 would hide the LoRA path
        m(x).square().mean().backward()
        grads.append({n: p.grad.full_tensor() for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]) and g.any(), name


def test_meta_built_fsdp2_tp_model_initialises_and_steps_like_the_constructed_one():
    _dist.run_ranks(DP * TP, _meta_init_under_fsdp, 7, True)


def test_meta_built_fsdp2_model_of_single_device_lora_layers_initialises_like_the_constructed_one():
    _dist.run_ranks(DP, _meta_init_under_fsdp, 7, False)


def _adapter_file_round_trip_under_fsdp(root: str) -> None:
    """``save_adapter`` gathers each adapter over both mesh dims (FSDP2's shards of TP's), ``load_adapter`` keeps
    each rank's part of both: the file holds the full tensors, and a fresh model gets them back exactly."""
    mesh = _dist.mesh((DP, TP), ("dp", "tp"))
    models = [_fully_shard(_mlp(mesh, seed), mesh) for seed in (3, 4)]
    with torch.no_grad():
        for layer in (models[0][0], models[0][2]):
            layer.lora_B.weight.to_local().normal_()  # B = 0 would make a lost B invisible
    want = {n: p.full_tensor() for n, p in models[0].named_parameters() if "lora_" in n}
    save_adapter(models[0], root)
    saved = load_file(f"{root}/adapter_model.safetensors")
    assert saved.keys() == {f"base_model.model.{n}" for n in want}
    assert all(torch.equal(saved[f"base_model.model.{n}"], t) for n, t in want.items())
    load_adapter(models[1], root)
    for name, p in models[1].named_parameters():
        if "lora_" in name:
            assert p.device_mesh.ndim == 2 and torch.equal(p.full_tensor(), want[name]), name


def test_adapter_file_saved_and_loaded_under_fsdp2_and_tp_holds_the_full_adapters(tmp_path):
    _dist.run_ranks(DP * TP, _adapter_file_round_trip_under_fsdp, str(tmp_path))


def _merge_under_fsdp(tp: bool) -> None:
    """``merge_lora`` on FSDP2's shards: each rank folds ``s B A`` into its shard of W (A gathered over dp), so
    the merged model computes the adapted function; ``unmerge_lora`` restores every shard bit for bit."""
    mesh = _dist.mesh((DP, TP), ("dp", "tp")) if tp else _dist.mesh((DP,), ("dp",))
    model = _mlp(mesh, 7)
    for layer in (model[0], model[2]):
        with torch.no_grad():
            b = layer.lora_B.weight
            (b.to_local() if isinstance(b, DTensor) else b).normal_(0.0, 0.5)  # B = 0 would merge nothing
    model = _fully_shard(model, mesh).eval()
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    x = torch.randn(BATCH, SEQ, K)
    y = model(x)
    merge_lora(model)
    for layer, name in ((model[0], "0"), (model[2], "2")):
        assert layer.merged, name
        w, a, b = (before[f"{name}.{n}"] for n in ("weight", "lora_A.weight", "lora_B.weight"))
        want = w + layer.scale * b @ a
        _close(layer.weight.full_tensor(), want, f"merged {name}.weight")
    _close(model(x), y, "merged output")
    unmerge_lora(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), f"{n} not restored by unmerge_lora"


@pytest.mark.parametrize("tp", [True, False], ids=["fsdp2-tp", "fsdp2"])
def test_merge_lora_under_fsdp2_folds_each_shard_and_unmerge_restores_it(tp):
    _dist.run_ranks(DP * TP if tp else DP, _merge_under_fsdp, tp)


# ------------------------------------------------------------------------------------ the torchtitan recipe
class _Block(nn.Module):
    """Pre-norm residual MLP: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(K), nn.Linear(K, H), nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _save_dropout_seeds():
    """Selective activation checkpointing that saves the dropout seeds and recomputes the rest (torchtitan has op-level
    policies). On the CPU, torch 2.13's AOTAutograd cannot recompute a random op next to DTensor gradients
    (tests/tp/test_layers_dropout.py pins it); on CUDA plain checkpointing replays the seed draw."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is torch.ops.parallel_lora.dropout_seed.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _recipe_model(mesh, *, meta: bool, recipe: bool) -> nn.Module:
    """Two blocks with LoRA dropout, TP with SP through ``lora_plan``, FSDP2; with ``recipe``, each block is also
    activation-checkpointed and compiled whole (torchtitan's order: TP, AC, compile, FSDP)."""
    cfg = LoRAConfig(r=R, alpha=6, dropout=0.1, target_modules=("up", "down"))
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}  # fmt: skip
    torch.manual_seed(99)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = apply_lora(nn.Sequential(_Block(), _Block()), cfg, verbose=False)
    for i, block in enumerate(model):
        parallelize_module(block, mesh["tp"], lora_plan(plan))
        if recipe:
            # Static shapes: the blocks share checkpoint_wrapper's code, and the second block's input (another
            # stride, requiring grad) would recompile it with dynamic shapes, which torch 2.13 does not trace through
            # SequenceParallel's DTensor norm.
            block = checkpoint_wrapper(block, context_fn=_save_dropout_seeds)
            model[i] = torch.compile(block, fullgraph=True, dynamic=False, backend="aot_eager")
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ColumnParallelLoRALinear | RowParallelLoRALinear)]


def _recipe_step(model: nn.Module, opt: torch.optim.Optimizer, mesh) -> float:
    """One AdamW step on data from the current generator (the same on every rank; each dp rank takes its batch
    and, under SP, each tp rank its sequence shard); returns this rank's loss."""
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    x_all = torch.randn(DP, BATCH, SEQ, K)
    loss = model(x_all[dp_rank].chunk(TP, dim=1)[tp_rank]).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _torchtitan_recipe_trains_like_the_plain_model(steps: int = 3) -> None:
    mesh = _dist.mesh((DP, TP), ("dp", "tp"))
    plain = _recipe_model(mesh, meta=False, recipe=False)
    torch.manual_seed(5)
    for layer in _lora_layers(plain):
        layer.reset_lora_parameters()
    model = _recipe_model(mesh, meta=True, recipe=True)
    model.to_empty(device=_dist.device())
    pretrained = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True))
    base = {k: v for k, v in pretrained.items() if "lora_" not in k}
    set_model_state_dict(model, base, options=StateDictOptions(full_state_dict=True, strict=False))
    torch.manual_seed(5)
    for layer in _lora_layers(model):
        layer.reset_lora_parameters()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"{name} differs after the recipe's init"

    losses = []
    for m in (plain, model):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-2)
        torch.manual_seed(11)
        losses.append([_recipe_step(m, opt, mesh) for _ in range(steps)])
    assert losses[0] == losses[1], f"losses differ: plain {losses[0]}, recipe {losses[1]}"
    assert len(set(losses[0])) == steps, "training did not move the loss"
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"{name} differs after {steps} steps"


@pytest.mark.slow
def test_torchtitan_recipe_meta_sp_checkpoint_compile_fsdp2_trains_like_the_plain_model():
    _dist.run_ranks(DP * TP, _torchtitan_recipe_trains_like_the_plain_model)


def _recipe_resumes_from_its_own_state_dict(root: str, steps: int = 2) -> None:
    """torchtitan's checkpointing (the model's and the optimizer's state dicts through DCP, nothing of ours) on
    the recipe model: a run rebuilt on the meta device and resumed from step ``steps`` draws the masks the
    uninterrupted run drew (they follow the generators, seeded here per step), so its next losses and adapters match
    bit for bit."""
    mesh = _dist.mesh((DP, TP), ("dp", "tp"))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _recipe_model(mesh, meta=True, recipe=True)
        model.to_empty(device=_dist.device())
        torch.manual_seed(5)
        reset_every_module(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)

    def step(model, opt, i: int) -> float:
        torch.manual_seed(1000 + i)  # the data of step i
        return _recipe_step(model, opt, mesh)

    model, opt = build()
    for i in range(steps):
        step(model, opt, i)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root)
    want = [step(model, opt, i) for i in range(steps, 2 * steps)]

    resumed, resumed_opt = build()
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = [step(resumed, resumed_opt, i) for i in range(steps, 2 * steps)]
    assert got == want, f"resumed losses {got} != uninterrupted {want}"
    for (name, p), q in zip(resumed.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"{name} differs after resuming"


def test_torchtitan_style_resume_of_the_recipe_reproduces_the_uninterrupted_run(tmp_path):
    _dist.run_ranks(DP * TP, _recipe_resumes_from_its_own_state_dict, str(tmp_path))

