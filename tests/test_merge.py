"""merge_lora / unmerge_lora / disable_adapter on single-device layers.

Reference: the unmerged layer's own output (merging must not change the function) and the base
``nn.Linear`` (disabling the adapter must give exactly the base).
"""

import copy

import pytest
import torch
import torch.nn as nn

from parallel_lora import LoRAConfig, apply_lora, disable_adapter, merge_lora, unmerge_lora


def _model(dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8)).to(dtype)
    model = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, dropout=dropout, target_modules="all-linear"),
                       verbose=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    return base, model


def test_merged_model_computes_the_same_function():
    _, model = _model()
    x = torch.randn(5, 16)
    before = model(x)
    merge_lora(model)
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmerge_restores_the_base_weight_bit_for_bit(dtype):
    _, model = _model(dtype)
    weights = [m.weight.detach().clone() for m in model if hasattr(m, "lora_A")]
    merge_lora(model)
    assert any(not torch.equal(m.weight, w) for m, w in zip([m for m in model if hasattr(m, "lora_A")], weights,
                                                             strict=True))
    unmerge_lora(model)
    for m, w in zip([m for m in model if hasattr(m, "lora_A")], weights, strict=True):
        assert torch.equal(m.weight, w)
        assert not m.merged


def test_merge_refuses_training_mode_with_dropout_but_allows_eval():
    _, model = _model(dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="dropout=0.1"):
        merge_lora(model)
    model.eval()
    merge_lora(model)
    assert all(m.merged for m in model if hasattr(m, "lora_A"))


def test_merge_in_training_mode_without_dropout_is_allowed():
    _, model = _model(dropout=0.0)
    model.train()
    merge_lora(model)


def test_disable_adapter_gives_exactly_the_base_and_restores():
    base, model = _model()
    x = torch.randn(3, 16)
    with_adapter = model(x)
    with disable_adapter(model):
        assert torch.equal(model(x), base(x))
    torch.testing.assert_close(model(x), with_adapter)
    assert not torch.equal(with_adapter, base(x))  # the check above is not vacuous
