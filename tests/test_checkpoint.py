"""Adapter files (PEFT format) and training-state checkpoints on one process.

References: Hugging Face PEFT itself (it must load what we save and we must load what it saves, with the
same outputs), and the model state before saving (a load must restore it exactly). Multi-rank resharding
is in ``test_checkpoint_parallel.py``.
"""

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from parallel_lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    latest_checkpoint,
    load_adapter,
    load_checkpoint,
    merge_lora,
    save_adapter,
    save_checkpoint,
)
from parallel_lora.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS

TARGETS = ("q_proj", "up_proj", "down_proj")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(12, 12)
        self.up_proj = nn.Linear(12, 20, bias=False)
        self.down_proj = nn.Linear(20, 12)
        self.head = nn.Linear(12, 12)  # not adapted

    def forward(self, x):
        return self.head(self.down_proj(torch.relu(self.up_proj(self.q_proj(x)))))


def _base():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _adapted(base, r=4, alpha=8, seed=1):
    torch.manual_seed(seed)
    model = apply_lora(copy.deepcopy(base), LoRAConfig(r=r, alpha=alpha, target_modules=TARGETS), verbose=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    return model


def _adapter_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_saved_file_has_peft_keys_shapes_and_config(tmp_path):
    model = _adapted(_base())
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
    base = _base()
    ours = _adapted(base)
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
    base = _base()
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), **patterns)
    theirs = peft.get_peft_model(copy.deepcopy(base), cfg)
    for name, p in theirs.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    theirs.save_pretrained(tmp_path)
    ours = _mixed(base, seed=9) if patterns else _adapted(base, seed=9)
    load_adapter(ours, tmp_path)
    x = torch.randn(4, 12)
    want = theirs(x)  # large (B ~ N(0, 1)): fp32 rounding of the other summation order is ~1e-6 of it
    torch.testing.assert_close(ours(x), want, atol=1e-6 * want.abs().max().item(), rtol=1e-6)


def test_peft_alpha_pattern_that_changes_a_scale_is_refused_not_loaded_with_the_wrong_one(tmp_path):
    # The tensors have the shapes the model expects, so only the config says q_proj's scale is 32 / 4, not 8 / 4.
    peft = pytest.importorskip("peft")
    base = _base()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), alpha_pattern={"q_proj": 32})
    peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(tmp_path)
    model = _adapted(base, seed=9)
    before = _adapter_state(model)
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
    base = _base()
    saved = _adapted(base, seed=1)
    save_adapter(saved, tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **pattern}))
    model = _adapted(base, seed=2)
    load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in _adapter_state(saved).items())


@pytest.mark.parametrize(
    "feature",
    [{"use_dora": True}, {"lora_bias": True}, {"bias": "lora_only"}, {"modules_to_save": ["head"]},
     {"alora_invocation_tokens": [5, 6]}, {"rank_pattern": {"down_proj": 2}}],
    ids=lambda f: next(iter(f)),
)
def test_adapter_using_a_peft_feature_we_do_not_compute_is_refused_by_name(tmp_path, feature):
    # Same tensors as a plain adapter: the refusal must come from the config, not from a key or shape check.
    base = _base()
    save_adapter(_adapted(base, seed=1), tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **feature}))
    model = _adapted(base, seed=2)
    before = _adapter_state(model)
    with pytest.raises(ValueError, match=next(iter(feature))):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_adapter_keys_are_the_unwrapped_models_under_compile_checkpoint_and_data_parallel(tmp_path):
    # Training wraps parts of the model (torchtitan: checkpoint_wrapper, then torch.compile); the file must
    # still name the plain model's modules, or PEFT finds none of its keys and loads nothing.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    peft = pytest.importorskip("peft")
    base = _base()
    ours = _adapted(base)
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
    other = _adapted(base, seed=4)
    load_adapter(nn.DataParallel(torch.compile(other)), plain_dir)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in _adapter_state(ours).items())


def test_a_plain_submodule_named_module_keeps_its_name_in_adapter_keys(tmp_path):
    model = nn.Module()
    model.module = _adapted(_base())  # not a DDP wrapper: part of the model's own path
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
    base = _base()
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
    assert all(torch.equal(other.state_dict()[k], v) for k, v in _adapter_state(ours).items())
    uniform = _adapted(base)  # every layer at r=4: the file's down_proj adapters do not fit
    with pytest.raises(ValueError, match=r"module '0.down_proj' r=2, lora_alpha=6 \(rank_pattern.*alpha_pattern"):
        load_adapter(uniform, tmp_path)


def test_round_trip_restores_adapters_exactly(tmp_path):
    base = _base()
    saved = _adapted(base, seed=1)
    save_adapter(saved, tmp_path)
    fresh = _adapted(base, seed=2)
    assert not all(torch.equal(a, b) for a, b in zip(_adapter_state(saved).values(), _adapter_state(fresh).values(),
                                                      strict=True))
    load_adapter(fresh, tmp_path)
    for k, v in _adapter_state(saved).items():
        assert torch.equal(fresh.state_dict()[k], v), k


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("truncate", "truncated or corrupt"),
        ("wrong_r", "r=2"),
        ("wrong_alpha", "lora_alpha=3"),
        ("missing_key", "base_model.model.1.down_proj.lora_B.weight"),
        ("wrong_shape", r"\(4, 13\)"),
        ("extra_key", "lacks"),
    ],
)
def test_bad_file_is_refused_and_model_left_unchanged(tmp_path, corrupt, message):
    base = _base()
    save_adapter(_adapted(base, seed=1), tmp_path)
    weights, config_path = tmp_path / ADAPTER_WEIGHTS, tmp_path / ADAPTER_CONFIG
    tensors = load_file(weights)
    config = json.loads(config_path.read_text())
    if corrupt == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif corrupt == "wrong_r":
        config["r"] = 2
    elif corrupt == "wrong_alpha":
        config["lora_alpha"] = 3
    elif corrupt == "missing_key":
        del tensors["base_model.model.1.down_proj.lora_B.weight"]
    elif corrupt == "wrong_shape":
        # the first tensor stays valid, so a partial load would be visible
        tensors["base_model.model.1.q_proj.lora_A.weight"] = torch.zeros(4, 13)
    elif corrupt == "extra_key":
        tensors["base_model.model.9.q_proj.lora_A.weight"] = torch.zeros(4, 12)
    if corrupt != "truncate":
        save_file(tensors, weights)
        config_path.write_text(json.dumps(config))
    model = _adapted(base, seed=2)
    before = _adapter_state(model)
    with pytest.raises(ValueError, match=message):
        load_adapter(model, tmp_path)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), f"{k} changed by a failed load"


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p != path)


def test_a_failed_save_leaves_the_previous_adapter_intact(tmp_path, monkeypatch):
    base = _base()
    out = tmp_path / "adapter"
    save_adapter(_adapted(base, seed=1), out)
    good = (out / ADAPTER_WEIGHTS).read_bytes()

    import safetensors.torch

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save", crash)
    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_adapter(_adapted(base, seed=2), out)
    assert (out / ADAPTER_WEIGHTS).read_bytes() == good
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    assert _siblings(out) == []  # no temporary directory left beside it


def _contents(folder: Path) -> tuple[list[str], bytes, dict[str, bytes]]:
    """File names, config bytes, and each tensor's bytes (safetensors may order header metadata differently)."""
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    return (sorted(p.name for p in folder.iterdir()), (folder / ADAPTER_CONFIG).read_bytes(),
            {k: v.numpy().tobytes() for k, v in tensors.items()})


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4, 5])
def test_an_adapter_directory_changes_as_a_whole(tmp_path, monkeypatch, crash_at):
    # The second save has other tensors and another alpha (same shapes): a mixed pair would load at the wrong
    # scale. Interrupt it at its n-th fsync, whatever the writer does in between: the directory must then hold
    # the first pair or the second, never one file of each.
    base = _base()
    out = tmp_path / "adapter"
    first, second = _adapted(base, alpha=8, seed=1), _adapted(base, alpha=16, seed=2)
    save_adapter(first, out)
    old = _contents(out)
    save_adapter(second, tmp_path / "reference")
    new = _contents(tmp_path / "reference")
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == crash_at:
            raise OSError("interrupted")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        save_adapter(second, out)
    except OSError:
        pass
    monkeypatch.undo()
    now = _contents(out)
    assert now in (old, new), f"crash at fsync {crash_at}: a mixed or torn directory"
    loaded = _adapted(base, alpha=8 if now == old else 16, seed=3)
    load_adapter(loaded, out)
    want = _adapter_state(first if now == old else second)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    assert _siblings(out) == ["reference"]  # no temporary directory left beside it


def _flip_a_tensor_byte(weights: Path, where: str = "first") -> None:
    data = bytearray(weights.read_bytes())
    header = int.from_bytes(data[:8], "little")
    index = 8 + header + 5 if where == "first" else len(data) - 1  # inside the first (last) tensor's values
    data[index] ^= 0x10
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_byte_in_the_tensor_data_is_refused_naming_the_file(tmp_path, where):
    base = _base()
    save_adapter(_adapted(base, seed=1), tmp_path)
    _flip_a_tensor_byte(tmp_path / ADAPTER_WEIGHTS, where)
    model = _adapted(base, seed=2)
    before = _adapter_state(model)
    with pytest.raises(ValueError, match=rf"{ADAPTER_WEIGHTS}.*checksum"):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_save_adapter_serializes_the_tensors_once(tmp_path, monkeypatch):
    import safetensors.torch

    calls = []
    real_save = safetensors.torch.save
    monkeypatch.setattr(safetensors.torch, "save", lambda *a, **k: calls.append(1) or real_save(*a, **k))
    save_adapter(_adapted(_base()), tmp_path)
    assert len(calls) == 1  # the checksum is taken from the tensors, not from a first serialization


def test_a_file_whose_record_hashes_the_data_section_is_still_checked(tmp_path):
    # The record's first form: the sha256 of the file's data section under "tensors_sha256".
    from safetensors.torch import save

    from parallel_lora.peft_format import RECORD

    base = _base()
    save_adapter(_adapted(base, seed=1), tmp_path)
    weights = tmp_path / ADAPTER_WEIGHTS
    tensors = {k: v.clone() for k, v in load_file(weights).items()}  # not views of the file rewritten below
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    plain = save(tensors, metadata={"format": "pt"})
    sha = hashlib.sha256(plain[8 + int.from_bytes(plain[:8], "little"):]).hexdigest()
    record = {"tensors_sha256": sha, "config": {k: config[k] for k in ("r", "lora_alpha", "use_rslora",
                                                                       "rank_pattern", "alpha_pattern")}}
    weights.write_bytes(save(tensors, metadata={"format": "pt", RECORD: json.dumps(record)}))
    model = load_adapter(_adapted(base, seed=2), tmp_path)
    assert all(torch.equal(model.state_dict()[k[len("base_model.model."):]], v) for k, v in tensors.items())
    _flip_a_tensor_byte(weights)
    with pytest.raises(ValueError, match=rf"{ADAPTER_WEIGHTS}.*checksum"):
        load_adapter(_adapted(base, seed=2), tmp_path)


def test_a_pair_mixed_by_hand_is_refused(tmp_path):
    # Same shapes, another alpha: only the record of what the tensors were saved with can tell.
    base = _base()
    save_adapter(_adapted(base, alpha=8, seed=1), tmp_path / "a")
    save_adapter(_adapted(base, alpha=16, seed=2), tmp_path / "b")
    (tmp_path / "a" / ADAPTER_WEIGHTS).write_bytes((tmp_path / "b" / ADAPTER_WEIGHTS).read_bytes())
    model = _adapted(base, alpha=8, seed=3)
    with pytest.raises(ValueError, match=r"not the config these tensors were saved with.*lora_alpha=8.*lora_alpha=16"):
        load_adapter(model, tmp_path / "a")


def test_peft_loads_our_adapter_without_a_warning(tmp_path):
    peft = pytest.importorskip("peft")
    import warnings

    save_adapter(_adapted(_base()), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = peft.PeftConfig.from_pretrained(tmp_path)
    assert (config.r, config.lora_alpha) == (4, 8)


def test_save_adapter_refuses_a_directory_holding_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes.txt"):
        save_adapter(_adapted(_base()), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_load_adapter_refuses_a_merged_model_and_leaves_it_unchanged(tmp_path):
    base = _base()
    save_adapter(_adapted(base, seed=1), tmp_path)
    model = _adapted(base, seed=2).eval()
    merge_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"merged.*unmerge_lora\(\) first"):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(m.merged for m in model.modules() if isinstance(m, LoRALinear))


def test_a_bare_layer_saves_under_its_own_keys_and_loads_back(tmp_path):
    config = LoRAConfig(r=4, alpha=8)
    torch.manual_seed(0)
    layer = LoRALinear(12, 20, config)
    nn.init.normal_(layer.lora_B.weight)
    save_adapter(layer, tmp_path)
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "base_model.model.lora_A.weight": (4, 12), "base_model.model.lora_B.weight": (20, 4)}
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["target_modules"] == []
    other = LoRALinear(12, 20, config)
    load_adapter(other, tmp_path)
    assert torch.equal(other.lora_A.weight, layer.lora_A.weight)
    assert torch.equal(other.lora_B.weight, layer.lora_B.weight)
    with pytest.raises(ValueError, match=r"base_model.model.0.q_proj.lora_A.weight"):
        load_adapter(_adapted(_base()), tmp_path)  # a model's layers have module paths: the keys differ


def test_training_checkpoint_restores_adapters_optimizer_step_and_rng(tmp_path):
    base = _base()
    model = _adapted(base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(6, 12)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(123)
    save_checkpoint(tmp_path, model, opt, step=2, extra={"note": "x"})
    expected_rand = torch.rand(3)
    model(x).square().mean().backward()
    opt.step()
    expected_after = _adapter_state(model)

    other = _adapted(base, seed=5)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step_00000002"
    meta = load_checkpoint(path, other, other_opt)
    assert meta["step"] == 2 and meta["extra"] == {"note": "x"}
    assert torch.equal(torch.rand(3), expected_rand)
    other(x).square().mean().backward()
    other_opt.step()
    for k, v in expected_after.items():
        torch.testing.assert_close(other.state_dict()[k], v, atol=0, rtol=0)


def test_interrupted_save_is_never_the_latest(tmp_path):
    model = _adapted(_base())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, model, opt, step=1)
    (tmp_path / "step_00000002.tmp").mkdir()  # what a crash mid-save leaves behind
    (tmp_path / "step_00000003").mkdir()  # a directory without the completion marker
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_00000003", model, opt)


def test_checkpoint_of_another_rank_is_refused_by_name_before_loading(tmp_path):
    base = _base()
    model = _adapted(base, r=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, model, opt, step=1)
    other = _adapted(base, r=2, seed=5)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    before = _adapter_state(other)
    with pytest.raises(ValueError, match=r"'0.q_proj.lora_A.weight' is \[4, 12\] in the checkpoint and \[2, 12\]"):
        load_checkpoint(latest_checkpoint(tmp_path), other, other_opt)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
