"""``LoRALinear`` and ``apply_lora`` on one device.

Reference: the wrapped ``nn.Linear`` itself (``B = 0`` at init, so the LoRA layer must reproduce it bit for
bit on the eager path), PEFT's conventions (``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``, A from
``kaiming_uniform_(a=sqrt(5))``, ``"all-linear"`` leaves ``lm_head`` alone, a target matches a dotted suffix
of the module path) and the distributions named in ``LoRAConfig.init_A``'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _recipes import reset_every_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel_lora import LoRAConfig, LoRALinear, apply_lora, merge_lora
from parallel_lora.dropout import CallSeeds

F32, BF16 = torch.float32, torch.bfloat16
D, V = 16, 24  # model width, vocabulary


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=True)

    def forward(self, h):
        return self.o_proj(torch.tanh(self.q_proj(h) * self.k_proj(h)) + self.v_proj(h))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h):
        return self.down(torch.relu(self.up(h)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(D), Attention(), MLP()

    def forward(self, h):
        h = h + self.attn(self.norm(h))
        return h + self.mlp(h)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.layers:
            h = block(h)
        return self.lm_head(h)


ATTN = [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
MLPS = [f"layers.{i}.mlp.{p}" for i in range(2) for p in ("up", "down")]


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


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
# apply_lora
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (("q_proj", "k_proj", "v_proj", "o_proj"), ATTN),
        (("up",), ["layers.0.mlp.up", "layers.1.mlp.up"]),
        (("mlp.*",), MLPS),
        (("layers.*.mlp.*",), MLPS),
        (("layers.1.attn.q_proj",), ["layers.1.attn.q_proj"]),
        (("*_proj", "down"), ATTN + ["layers.0.mlp.down", "layers.1.mlp.down"]),
        ("all-linear", ATTN + MLPS),
    ],
    ids=["names", "one-name", "glob-mlp.*", "glob-full-path", "full-path", "glob-and-name", "all-linear"],
)
def test_apply_lora_swaps_exactly_the_matching_linears(targets, expected):
    model = Toy()
    returned = apply_lora(model, LoRAConfig(r=2, target_modules=targets), verbose=False)
    assert returned is model
    swapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert sorted(swapped) == sorted(expected)
    assert sorted(model.lora_summary["modules"]) == sorted(expected)
    assert type(model.lm_head) is nn.Linear  # never adapted here, "all-linear" included


def test_a_second_apply_lora_leaves_the_first_ones_adapters_trainable():
    model = apply_lora(Toy(), LoRAConfig(r=4, target_modules=ATTN), verbose=False)
    apply_lora(model, LoRAConfig(r=2, target_modules=MLPS), verbose=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_params(model)) and len(trainable) == 2 * len(ATTN + MLPS)
    assert model.layers[0].attn.q_proj.config.r == 4 and model.layers[0].mlp.up.config.r == 2
    assert sorted(model.lora_summary["modules"]) == sorted(MLPS)


class _NamedHead(nn.Module):
    """A Hugging Face-style model whose output projection is not called lm_head (BioGPT, GIT, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.output_projection = nn.Linear(D, D), nn.Linear(D, V)

    def get_output_embeddings(self) -> nn.Module:
        return self.output_projection


def test_all_linear_leaves_the_output_embeddings_alone_whatever_their_name():
    model = apply_lora(_NamedHead(), LoRAConfig(r=2, target_modules="all-linear"), verbose=False)
    assert model.lora_summary["modules"] == ["body"]
    named = apply_lora(_NamedHead(), LoRAConfig(r=2, target_modules=("output_projection",)), verbose=False)
    assert named.lora_summary["modules"] == ["output_projection"]  # asked for by name: adapted


def test_apply_lora_freezes_everything_but_the_adapters():
    model = apply_lora(Toy(), LoRAConfig(r=2, target_modules="all-linear"), verbose=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_params(model))
    assert len(trainable) == 2 * len(ATTN + MLPS)
    assert not model.embed.weight.requires_grad and not model.layers[0].norm.weight.requires_grad


def test_lora_summary_counts_adapter_parameters():
    base_total = sum(p.numel() for p in Toy().parameters())
    model = apply_lora(Toy(), LoRAConfig(r=3), verbose=False)
    adapters = sum(p.numel() for p in lora_params(model).values())
    assert model.lora_summary["trainable"] == adapters == len(ATTN) * 3 * (D + D)
    assert model.lora_summary["total"] == base_total + adapters


def test_apply_lora_keeps_the_model_output_at_init():
    model = Toy()
    ids = torch.randint(0, V, (2, 7))
    before = model(ids)
    apply_lora(model, LoRAConfig(r=2, target_modules="all-linear", backend="torch"), verbose=False)
    assert torch.equal(model(ids), before)


def test_apply_lora_without_a_match_lists_the_linears():
    with pytest.raises(ValueError) as err:
        apply_lora(Toy(), LoRAConfig(target_modules=("gate_proj",)), verbose=False)
    message = str(err.value)
    assert "gate_proj" in message and "layers.0.attn.q_proj" in message


class _ScaledLinear(nn.Linear):
    """An nn.Linear subclass whose forward is not x W^T + b: replacing it with a LoRALinear would drop the x2."""

    def forward(self, x):
        return 2 * super().forward(x)


def _apply_lora_output(verbose: bool = True) -> str:
    """Everything ``apply_lora`` prints on this rank, on stdout and stderr."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        apply_lora(Toy(), LoRAConfig(r=2, target_modules="all-linear"), verbose=verbose)
    return out.getvalue()


def test_apply_lora_prints_its_summary_once_on_rank_0_of_two():
    rank0, rank1 = run_ranks(2, _apply_lora_output)
    assert rank0.count("apply_lora: 12 modules adapted") == 1, rank0
    assert rank1 == ""


def test_apply_lora_logs_through_the_parallel_lora_logger():
    assert _apply_lora_output(verbose=False) == ""  # DEBUG, below the logger's default level (INFO)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("parallel_lora")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        apply_lora(Toy(), LoRAConfig(r=2, target_modules="all-linear"), verbose=False)
        apply_lora(Toy(), LoRAConfig(r=2, target_modules="all-linear"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [(r.levelno, r.getMessage().split(";")[0]) for r in records] == [
        (logging.DEBUG, "apply_lora: 12 modules adapted"), (logging.INFO, "apply_lora: 12 modules adapted")]


def test_apply_lora_leaves_linear_subclasses_alone_and_reports_them():
    model = nn.Sequential(nn.Linear(4, 4), _ScaledLinear(4, 4), nn.MultiheadAttention(4, 2))
    x = torch.randn(3, 4)
    want = model[1](x)
    apply_lora(model, LoRAConfig(r=2, target_modules="all-linear"), verbose=False)
    assert isinstance(model[0], LoRALinear) and type(model[1]) is _ScaledLinear
    assert model.lora_summary["modules"] == ["0"]
    assert model.lora_summary["skipped"] == ["1 (_ScaledLinear)", "2.out_proj (NonDynamicallyQuantizableLinear)"]
    assert torch.equal(model[1](x), want)
    with pytest.raises(ValueError, match=r"matched but left alone, as nn.Linear subclasses: \['0 \(_ScaledLinear\)'\]"):
        apply_lora(nn.Sequential(_ScaledLinear(4, 4)), LoRAConfig(r=2, target_modules=("0",)), verbose=False)


def test_adamw_step_changes_only_adapter_parameters():
    model = apply_lora(Toy(), LoRAConfig(r=2, target_modules="all-linear", backend="torch"), verbose=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Every parameter goes to the optimizer (with weight decay) to show that freezing alone protects the base.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, V, (2, 7))
    for _ in range(2):  # step 1 moves B off zero; only then does A get a non-zero gradient
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    adapters = set(lora_params(model))
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (name in adapters), f"{name}: changed={changed}"


def test_apply_lora_twice_does_not_adapt_the_adapters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_lora(model, LoRAConfig(r=2, target_modules="all-linear"), verbose=False)
    with pytest.raises(ValueError, match="no nn.Linear matches"):
        apply_lora(model, LoRAConfig(r=2, target_modules="all-linear"), verbose=False)


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
