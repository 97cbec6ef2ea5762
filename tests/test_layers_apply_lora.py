"""``apply_lora`` on one device: which ``nn.Linear`` modules it swaps, what it freezes, what it reports and logs.

Reference: PEFT's conventions (``"all-linear"`` leaves ``lm_head`` and the output embeddings alone, a target matches
a dotted suffix of the module path) on a two-block toy model; ``LoRALinear`` itself is in tests/test_layers.py.
"""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
import torch.nn as nn

from parallel_lora import LoRAConfig, LoRALinear, apply_lora
from tests._dist import run_ranks

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
