"""``LoRALinear`` on one device: construction, initialisation, reset, and its dropout under activation checkpointing.

Reference: the wrapped ``nn.Linear`` itself (``B = 0`` at init, so the LoRA layer must reproduce it bit for
bit on the eager path), PEFT's conventions (``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``, A from
``kaiming_uniform_(a=sqrt(5))``), the distributions named in ``LoRAConfig.init_A``'s docstring, and a plain eager
step for a checkpointed one. ``apply_lora`` is in tests/test_layers_apply_lora.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel_lora import LoRAConfig, LoRALinear, merge_lora
from parallel_lora._dropout import CallSeeds
from tests._recipes import reset_every_module

F32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# LoRALinear
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_from_linear_shares_and_freezes_the_base(bias):
    linear = nn.Linear(12, 20, bias=bias)
    layer = LoRALinear.from_linear(linear, LoRAConfig(r=4))
    assert layer.weight is linear.weight and layer.bias is linear.bias  # shared, not copied
    assert not layer.weight.requires_grad
    assert layer.bias is None or not layer.bias.requires_grad
    assert layer.lora_A.weight.requires_grad and layer.lora_B.weight.requires_grad
    assert (layer.in_features, layer.out_features) == (12, 20)


@pytest.mark.parametrize(
    ("base", "lora_dtype", "expected"),
    [(F32, None, F32), (BF16, None, BF16), (BF16, F32, F32), (F32, BF16, BF16)],
    ids=["fp32", "bf16", "fp32-over-bf16", "bf16-over-fp32"],
)
def test_adapters_have_peft_shapes_in_lora_dtype_or_weight_dtype(base, lora_dtype, expected):
    layer = LoRALinear.from_linear(nn.Linear(12, 20, dtype=base), LoRAConfig(r=4, lora_dtype=lora_dtype))
    assert layer.lora_A.weight.shape == (4, 12) and layer.lora_B.weight.shape == (20, 4)
    assert layer.lora_A.weight.dtype == expected and layer.lora_B.weight.dtype == expected
    assert layer.lora_A.bias is None and layer.lora_B.bias is None


@pytest.mark.parametrize(("base", "lora_dtype"), [(F32, None), (BF16, None), (BF16, F32)],
                         ids=["fp32", "bf16", "fp32-over-bf16"])  # fmt: skip
def test_output_equals_the_base_at_init(base, lora_dtype):
    linear = nn.Linear(12, 20, dtype=base)
    layer = LoRALinear.from_linear(linear, LoRAConfig(r=4, lora_dtype=lora_dtype, backend="torch"))
    assert torch.count_nonzero(layer.lora_B.weight) == 0 and torch.count_nonzero(layer.lora_A.weight) > 0
    x = torch.randn(3, 5, 12, dtype=base)
    y = layer(x)
    assert y.dtype == base
    assert torch.equal(y, linear(x))
    # Not vacuous: a non-zero B changes the output.
    with torch.no_grad():
        layer.lora_B.weight.fill_(1.0)
    assert not torch.allclose(layer(x), linear(x))


def test_constructor_builds_frozen_base_and_trainable_adapters():
    layer = LoRALinear(12, 20, LoRAConfig(r=4), bias=True, dtype=BF16)
    assert layer.weight.shape == (20, 12) and layer.bias.shape == (20,)
    assert layer.weight.dtype == BF16 and not layer.weight.requires_grad and not layer.bias.requires_grad
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]


# A [16, 2048] holds 32768 samples: a sample std is within ~0.5% of the true one (3% is > 5 sigma).
INIT_R, INIT_IN = 16, 2048


def _init_A(init):
    return LoRALinear(INIT_IN, 4, LoRAConfig(r=INIT_R, init_A=init)).lora_A.weight.detach()


@pytest.mark.parametrize(
    ("init", "bound"),
    [("kaiming", 1 / math.sqrt(INIT_IN)), ("xavier", math.sqrt(6 / (INIT_IN + INIT_R)))],
)
def test_uniform_init_A_fills_its_bound(init, bound):
    a = _init_A(init)
    assert a.abs().max() <= bound
    assert a.abs().max() > 0.99 * bound  # fills the range, not a narrower one
    assert a.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)  # U(-b, b) has std b / sqrt(3)
    assert abs(a.mean().item()) < 4 * bound / math.sqrt(3 * a.numel())


def test_gaussian_init_A_has_std_one_over_r():
    a = _init_A("gaussian")
    assert a.std().item() == pytest.approx(1 / INIT_R, rel=0.03)
    assert abs(a.mean().item()) < 4 / (INIT_R * math.sqrt(a.numel()))
    assert a.abs().max() > 3 / INIT_R  # unbounded tails, unlike the uniform inits


def test_init_A_choices_differ():
    """Not vacuous: the kaiming and xavier checks above use bounds far enough apart to tell them apart."""
    assert _init_A("xavier").abs().max() > 2 * _init_A("kaiming").abs().max()


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("how", ["device-argument", "device-context"])
def test_a_meta_built_layer_reset_after_to_empty_equals_the_constructed_one(how):
    cfg = LoRAConfig(r=4, lora_dtype=F32)
    torch.manual_seed(3)
    built = _params(LoRALinear(12, 20, cfg, bias=True, dtype=BF16))
    if how == "device-argument":
        layer = LoRALinear(12, 20, cfg, bias=True, dtype=BF16, device="meta")
    else:
        with torch.device("meta"):
            layer = LoRALinear(12, 20, cfg, bias=True, dtype=BF16)
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    torch.manual_seed(3)
    reset_every_module(layer)  # the layer's own reset, then its factors' (which must not draw B like a weight)
    got = _params(layer)
    assert got.keys() == built.keys()
    for name, want in built.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]


def test_reset_lora_parameters_redraws_A_zeroes_B_and_keeps_the_base():
    layer = LoRALinear(12, 20, LoRAConfig(r=4), bias=True)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    before = _params(layer)
    layer.reset_lora_parameters()
    after = _params(layer)
    assert torch.equal(after["weight"], before["weight"]) and torch.equal(after["bias"], before["bias"])
    assert not torch.equal(after["lora_A.weight"], before["lora_A.weight"])
    assert not after["lora_B.weight"].any()


def test_resetting_a_merged_layer_raises():
    layer = LoRALinear(12, 20, LoRAConfig(r=4)).eval()
    merge_lora(layer)
    for reset in (layer.reset_parameters, layer.reset_lora_parameters):
        with pytest.raises(ValueError, match=r"unmerge_lora\(\) first"):
            reset()


# ---------------------------------------------------------------------------------------------------------
# Activation checkpointing: the rerun draws the forward's dropout mask.
# ---------------------------------------------------------------------------------------------------------


def _outputs_and_grads(model: nn.Sequential, x: torch.Tensor, run) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = run(model, x)
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters() if p.requires_grad)]


def _two_lora_layers(cfg: LoRAConfig, act: nn.Module, dims: tuple[int, int, int], device: str, dtype=None):
    """``LoRALinear, act, LoRALinear`` in training mode with random B (B = 0 would hide dB), and an input."""
    k, h, n = dims
    with torch.device(device):
        model = nn.Sequential(LoRALinear(k, h, cfg, dtype=dtype), act, LoRALinear(h, n, cfg, dtype=dtype)).train()
        x = torch.randn(24, k, dtype=dtype)
    for layer in (model[0], model[2]):
        nn.init.normal_(layer.lora_B.weight)
    return model, x


def _assert_same_step_as_eager(model: nn.Sequential, x: torch.Tensor, run, what: str) -> list[torch.Tensor]:
    """``run``'s outputs and gradients equal a plain eager step's bit for bit, from the same generator states (the
    dropout seeds are drawn on x's device; the checkpoint tags on the CPU); returns the eager step's."""
    devices = [x.device] if x.is_cuda else []
    with torch.random.fork_rng(devices):
        want = _outputs_and_grads(model, x, lambda m, x: m(x))
    got = _outputs_and_grads(model, x, run)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"output/grad {i} differs {what}"
    return want


def _checkpointing_reruns_the_forward_dropout_mask(use_reentrant: bool, device: str, dtype: torch.dtype) -> None:
    # The rerun rebuilds S = s * drop(x) A^T for dB: under another mask than the forward's, dB would be wrong.
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.5, lora_dtype=torch.float32)
    model, x = _two_lora_layers(cfg, nn.GELU(), (64, 48, 32), device, dtype)
    checkpointed = lambda m, x: checkpoint(m, x, use_reentrant=use_reentrant)  # noqa: E731
    want = _assert_same_step_as_eager(model, x, checkpointed, "under checkpointing")
    # The check can fail: the next forward draws another mask, so its gradients differ.
    assert not torch.equal(_outputs_and_grads(model, x, lambda m, x: m(x))[-1], want[-1])


REENTRANT = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


@REENTRANT
def test_activation_checkpointing_reruns_the_forward_dropout_mask(use_reentrant):
    _checkpointing_reruns_the_forward_dropout_mask(use_reentrant, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@REENTRANT
def test_gpu_activation_checkpointing_reruns_the_forward_dropout_mask(use_reentrant):
    # The fused kernels, and the rerun on autograd's device thread.
    _checkpointing_reruns_the_forward_dropout_mask(use_reentrant, "cuda", torch.bfloat16)


def _save_matmuls(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """A selective-checkpoint policy like torchtitan's: keep matmul outputs, recompute the rest."""
    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_selective_checkpointing_that_saves_matmuls_reruns_the_forward_dropout_mask(backend):
    # The eager path must not add the LoRA term into F.linear's output in place: a selective checkpoint that caches
    # that output refuses it ("Tensor cached during selective activation checkpoint has been mutated").
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.5, backend=backend)
    model, x = _two_lora_layers(cfg, nn.GELU(), (16, 12, 8), "cpu")
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    selective = lambda m, x: checkpoint(m, x, use_reentrant=False, context_fn=context)  # noqa: E731
    _assert_same_step_as_eager(model, x, selective, "under selective checkpointing")


def test_a_checkpoint_rerun_without_the_forwards_rng_state_raises():
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.1, backend="torch")
    layer = LoRALinear(16, 12, cfg).train()
    y = checkpoint(layer, torch.randn(6, 16, requires_grad=True), use_reentrant=False, preserve_rng_state=False)
    with pytest.raises(RuntimeError, match="preserve_rng_state=True"):
        y.sum().backward()


def test_a_rerun_after_more_in_flight_calls_than_kept_raises(monkeypatch):
    # GPipe-style: every micro-batch's forward before any backward; the first rerun's seed was dropped.
    monkeypatch.setattr(CallSeeds, "KEPT", 2)
    layer = LoRALinear(16, 12, LoRAConfig(r=4, alpha=8, dropout=0.1, backend="torch")).train()
    ys = [checkpoint(layer, torch.randn(6, 16, requires_grad=True), use_reentrant=False) for _ in range(3)]
    ys[2].sum().backward()  # the newest two are kept
    with pytest.raises(RuntimeError, match=r"last 2 forward calls.*CallSeeds.KEPT"):
        ys[0].sum().backward()
