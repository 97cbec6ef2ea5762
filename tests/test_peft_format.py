"""Adapter files against Hugging Face PEFT on one process: PEFT loads what we save, with the same outputs and
no warning, and we load what it saves (rank/alpha patterns included) or refuse what we do not compute."""

import copy
import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from parallel_lora import (
    LoRAConfig,
    apply_lora,
    load_adapter,
    save_adapter,
)
from parallel_lora._checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests._adapters import TARGETS, adapted, adapter_state, base_model


def test_saved_file_has_peft_keys_shapes_and_config(tmp_path):
    model = adapted(base_model())
    save_adapter(model, tmp_path)
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS)
    assert tensors["base_model.model.0.q_proj.lora_A.weight"].shape == (4, 12)
    assert tensors["base_model.model.1.up_proj.lora_B.weight"].shape == (20, 4)
    assert len(tensors) == 2 * 2 * len(TARGETS)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["bias"] == "none" and config["use_rslora"] is False
    assert sorted(config["target_modules"]) == sorted(TARGETS)


def test_peft_loads_our_adapter_with_identical_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    base = base_model()
    ours = adapted(base)
    save_adapter(ours, tmp_path)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    x = torch.randn(7, 12)
    torch.testing.assert_close(theirs(x), ours(x), atol=1e-6, rtol=1e-6)
    # and through get_peft_model + set_peft_model_state_dict, the route
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS))
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    peft.set_peft_model_state_dict(model, load_file(tmp_path / ADAPTER_WEIGHTS))
    torch.testing.assert_close(model(x), ours(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "patterns", [{}, {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"down_proj": 6}}],
    ids=["one_rank", "rank_and_alpha_patterns"],
)
def test_we_load_an_adapter_peft_saved(tmp_path, patterns):
    peft = pytest.importorskip("peft")
    base = base_model()
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), **patterns)
    theirs = peft.get_peft_model(copy.deepcopy(base), cfg)
    for name, p in theirs.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    theirs.save_pretrained(tmp_path)
    ours = _mixed(base, seed=9) if patterns else adapted(base, seed=9)
    load_adapter(ours, tmp_path)
    x = torch.randn(4, 12)
    want = theirs(x)  # large (B ~ N(0, 1)): fp32 rounding of the other summation order is ~1e-6 of it
    torch.testing.assert_close(ours(x), want, atol=1e-6 * want.abs().max().item(), rtol=1e-6)


def test_peft_alpha_pattern_that_changes_a_scale_is_refused_not_loaded_with_the_wrong_one(tmp_path):
    # The tensors have the shapes the model expects, so only the config says q_proj's scale is 32 / 4, not 8 / 4.
    peft = pytest.importorskip("peft")
    base = base_model()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), alpha_pattern={"q_proj": 32})
    peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(tmp_path)
    model = adapted(base, seed=9)
    before = adapter_state(model)
    with pytest.raises(ValueError, match=r"'0.q_proj' r=4, lora_alpha=32 \(alpha_pattern\['q_proj'\]\).*alpha=8"):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    "pattern",
    [{"alpha_pattern": {"q_proj": 8}, "rank_pattern": {"up_proj": 4}}, {"alpha_pattern": {"head": 64}},
     {"modules_to_save": [], "use_bdlora": False, "trainable_token_indices": {}, "bias": "none"}],
    ids=["patterns_with_the_same_values", "pattern_of_an_unadapted_module", "features_spelled_off"],
)
def test_peft_configs_that_agree_with_the_model_load(tmp_path, pattern):
    base = base_model()
    saved = adapted(base, seed=1)
    save_adapter(saved, tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **pattern}))
    model = adapted(base, seed=2)
    load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in adapter_state(saved).items())


@pytest.mark.parametrize(
    "feature",
    [{"use_dora": True}, {"lora_bias": True}, {"bias": "lora_only"}, {"modules_to_save": ["head"]},
     {"alora_invocation_tokens": [5, 6]}, {"rank_pattern": {"down_proj": 2}}],
    ids=lambda f: next(iter(f)),
)
def test_adapter_using_a_peft_feature_we_do_not_compute_is_refused_by_name(tmp_path, feature):
    # Same tensors as a plain adapter: the refusal must come from the config, not from a key or shape check.
    base = base_model()
    save_adapter(adapted(base, seed=1), tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **feature}))
    model = adapted(base, seed=2)
    before = adapter_state(model)
    with pytest.raises(ValueError, match=next(iter(feature))):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_adapter_keys_are_the_unwrapped_models_under_compile_checkpoint_and_data_parallel(tmp_path):
    # Training wraps parts of the model (torchtitan: checkpoint_wrapper, then torch.compile); the file must
    # still name the plain model's modules, or PEFT finds none of its keys and loads nothing.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    peft = pytest.importorskip("peft")
    base = base_model()
    ours = adapted(base)
    wrapped = nn.DataParallel(torch.compile(nn.Sequential(checkpoint_wrapper(ours[0]), torch.compile(ours[1]))))
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_modules())
    save_adapter(wrapped, tmp_path)
    plain_dir = tmp_path / "plain"
    save_adapter(ours, plain_dir)
    assert load_file(tmp_path / ADAPTER_WEIGHTS).keys() == load_file(plain_dir / ADAPTER_WEIGHTS).keys()
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    x = torch.randn(5, 12)
    torch.testing.assert_close(theirs(x), ours(x), atol=1e-6, rtol=1e-6)
    # and back into the wrapped model from the plain file
    other = adapted(base, seed=4)
    load_adapter(nn.DataParallel(torch.compile(other)), plain_dir)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in adapter_state(ours).items())


def test_a_plain_submodule_named_module_keeps_its_name_in_adapter_keys(tmp_path):
    model = nn.Module()
    model.module = adapted(base_model())  # not a DDP wrapper: part of the model's own path
    save_adapter(model, tmp_path)
    assert "base_model.model.module.0.q_proj.lora_A.weight" in load_file(tmp_path / ADAPTER_WEIGHTS)


def _mixed(base, seed=1):
    """q_proj and up_proj at r=4, alpha=8; down_proj at r=2, alpha=6 (two apply_lora calls), B non-zero."""
    torch.manual_seed(seed)
    model = apply_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "up_proj")),
                       verbose=False)
    apply_lora(model, LoRAConfig(r=2, alpha=6, target_modules=("down_proj",)), verbose=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    return model


def test_layers_of_different_ranks_save_with_peft_patterns_that_peft_loads(tmp_path):
    peft = pytest.importorskip("peft")
    base = base_model()
    ours = _mixed(base)
    save_adapter(ours, tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {r"0\.down_proj": 2, r"1\.down_proj": 2}
    assert config["alpha_pattern"] == {r"0\.down_proj": 6, r"1\.down_proj": 6}
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    x = torch.randn(5, 12)
    want = ours(x)  # large (B ~ N(0, 1)): fp32 rounding of PEFT's other summation order is ~1e-6 of it
    torch.testing.assert_close(theirs(x), want, atol=1e-6 * want.abs().max().item(), rtol=1e-6)
    other = _mixed(base, seed=2)
    load_adapter(other, tmp_path)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in adapter_state(ours).items())
    uniform = adapted(base)  # every layer at r=4: the file's down_proj adapters do not fit
    with pytest.raises(ValueError, match=r"module '0.down_proj' r=2, lora_alpha=6 \(rank_pattern.*alpha_pattern"):
        load_adapter(uniform, tmp_path)


def test_peft_loads_our_adapter_without_a_warning(tmp_path):
    peft = pytest.importorskip("peft")
    import warnings

    save_adapter(adapted(base_model()), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = peft.PeftConfig.from_pretrained(tmp_path)
    assert (config.r, config.lora_alpha) == (4, 8)
