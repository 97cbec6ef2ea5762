"""Adapter files and training-state checkpoints on one process: round trips restore the model exactly, a bad
or torn file is refused with the model unchanged, directories change as a whole. Against PEFT:
``test_peft_format.py``; multi-rank resharding: ``test_checkpoint_parallel.py``."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from parallel_lora import (
    LoRAConfig,
    LoRALinear,
    latest_checkpoint,
    load_adapter,
    load_checkpoint,
    merge_lora,
    save_adapter,
    save_checkpoint,
)
from parallel_lora._checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests import _adapters
from tests._adapters import adapted, adapter_state, base_model


def test_round_trip_restores_adapters_exactly(tmp_path):
    base = base_model()
    saved = adapted(base, seed=1)
    save_adapter(saved, tmp_path)
    fresh = adapted(base, seed=2)
    assert not all(torch.equal(a, b) for a, b in zip(adapter_state(saved).values(), adapter_state(fresh).values(),
                                                      strict=True))
    load_adapter(fresh, tmp_path)
    for k, v in adapter_state(saved).items():
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
    base = base_model()
    save_adapter(adapted(base, seed=1), tmp_path)
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
    model = adapted(base, seed=2)
    before = adapter_state(model)
    with pytest.raises(ValueError, match=message):
        load_adapter(model, tmp_path)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), f"{k} changed by a failed load"


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p != path)


def test_a_failed_save_leaves_the_previous_adapter_intact(tmp_path, monkeypatch):
    base = base_model()
    out = tmp_path / "adapter"
    save_adapter(adapted(base, seed=1), out)
    good = (out / ADAPTER_WEIGHTS).read_bytes()

    import safetensors.torch

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save", crash)
    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_adapter(adapted(base, seed=2), out)
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
    base = base_model()
    out = tmp_path / "adapter"
    first, second = adapted(base, alpha=8, seed=1), adapted(base, alpha=16, seed=2)
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
    loaded = adapted(base, alpha=8 if now == old else 16, seed=3)
    load_adapter(loaded, out)
    want = adapter_state(first if now == old else second)
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
    base = base_model()
    save_adapter(adapted(base, seed=1), tmp_path)
    _flip_a_tensor_byte(tmp_path / ADAPTER_WEIGHTS, where)
    model = adapted(base, seed=2)
    before = adapter_state(model)
    with pytest.raises(ValueError, match=rf"{ADAPTER_WEIGHTS}.*checksum"):
        load_adapter(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_save_adapter_serializes_the_tensors_once(tmp_path, monkeypatch):
    import safetensors.torch

    calls = []
    real_save = safetensors.torch.save
    monkeypatch.setattr(safetensors.torch, "save", lambda *a, **k: calls.append(1) or real_save(*a, **k))
    save_adapter(adapted(base_model()), tmp_path)
    assert len(calls) == 1  # the checksum is taken from the tensors, not from a first serialization


def test_a_pair_mixed_by_hand_is_refused(tmp_path):
    # Same shapes, another alpha: only the record of what the tensors were saved with can tell.
    base = base_model()
    save_adapter(adapted(base, alpha=8, seed=1), tmp_path / "a")
    save_adapter(adapted(base, alpha=16, seed=2), tmp_path / "b")
    (tmp_path / "a" / ADAPTER_WEIGHTS).write_bytes((tmp_path / "b" / ADAPTER_WEIGHTS).read_bytes())
    model = adapted(base, alpha=8, seed=3)
    with pytest.raises(ValueError, match=r"not the config these tensors were saved with.*lora_alpha=8.*lora_alpha=16"):
        load_adapter(model, tmp_path / "a")




def test_save_adapter_refuses_a_directory_holding_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes.txt"):
        save_adapter(adapted(base_model()), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_load_adapter_refuses_a_merged_model_and_leaves_it_unchanged(tmp_path):
    base = base_model()
    save_adapter(adapted(base, seed=1), tmp_path)
    model = adapted(base, seed=2).eval()
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
        load_adapter(adapted(base_model()), tmp_path)  # a model's layers have module paths: the keys differ


def test_training_checkpoint_restores_adapters_optimizer_step_and_rng(tmp_path):
    base = base_model()
    model = adapted(base)
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
    expected_after = adapter_state(model)

    other = adapted(base, seed=5)
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
    model = adapted(base_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, model, opt, step=1)
    (tmp_path / "step_00000002.tmp").mkdir()  # what a crash mid-save leaves behind
    (tmp_path / "step_00000003").mkdir()  # a directory without the completion marker
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_00000003", model, opt)


def test_checkpoint_of_another_rank_is_refused_by_name_before_loading(tmp_path):
    base = base_model()
    model = adapted(base, r=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, model, opt, step=1)
    other = adapted(base, r=2, seed=5)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    before = adapter_state(other)
    with pytest.raises(ValueError, match=r"'0.q_proj.lora_A.weight' is \[4, 12\] in the checkpoint and \[2, 12\]"):
        load_checkpoint(latest_checkpoint(tmp_path), other, other_opt)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_a_process_without_a_group_writes_whatever_rank_torchrun_gave_it(tmp_path, monkeypatch):
    # $RANK names this process's rank once it joins a group; without one it is the whole world, and a save that
    # left the writing to "rank 0" would write nothing.
    monkeypatch.setenv("RANK", "1")
    model = adapted(base_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    save_adapter(model, tmp_path / "adapter")
    save_checkpoint(tmp_path / "checkpoints", model, opt, step=1)
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000001"


def _saved(root: Path):
    model = adapted(base_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(6, 12)).square().mean().backward()
    opt.step()
    save_checkpoint(root, model, opt, step=2, extra={"seed": 0})
    return latest_checkpoint(root)


def _item_offset(path: Path, prefix: str) -> tuple[str, int]:
    """The file and the offset of the middle byte of the first DCP item whose name starts with ``prefix``."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    index, info = next((i, s) for i, s in storage.items() if i.fqn.startswith(prefix))
    return info.relative_path, info.offset + info.length // 2


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01  # one bit: in meta.json the step's last digit, "2" -> "3"
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["tensor shard", "optimizer state", "metadata", "rng state", "data position"])
def test_a_flipped_byte_in_any_checkpoint_file_is_refused_before_loading(tmp_path, kind):
    path = _saved(tmp_path)
    if kind in ("tensor shard", "optimizer state"):
        name, offset = _item_offset(path, "model." if kind == "tensor shard" else "optim.")
    else:
        name = {"metadata": ".metadata", "rng state": "rng_rank0.pt", "data position": "meta.json"}[kind]
        offset = (path / name).read_bytes().index(b'"step": 2') + 8 if kind == "data position" else 40
    _flip(path / name, offset)
    model = adapted(base_model(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before, rng = adapter_state(model), torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / name))} fails its checksum.*Delete"):
        load_checkpoint(path, model, opt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not opt.state and torch.equal(torch.get_rng_state(), rng)
    if kind == "data position":
        from parallel_lora._checkpoint import checkpoint_meta

        with pytest.raises(ValueError, match="meta.json fails its checksum"):
            checkpoint_meta(path)


def test_a_checkpoint_records_a_checksum_of_every_file_it_holds(tmp_path):
    path = _saved(tmp_path)
    recorded = json.loads((path / "checksums.json").read_text())["sha256"]
    assert sorted(recorded) == sorted(p.name for p in path.iterdir() if p.name not in ("checksums.json", ".complete"))
    assert {".metadata", "__0_0.distcp", "meta.json", "rng_rank0.pt"} <= recorded.keys()


def test_a_checkpoint_without_checksums_loads_with_one_warning(tmp_path, capsys):
    path = _saved(tmp_path)
    (path / "checksums.json").unlink()  # as checkpoints were saved before they recorded checksums
    model = adapted(base_model(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    capsys.readouterr()
    assert load_checkpoint(path, model, opt)["step"] == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} has no checksums.json" in err and "unverified" in err, err


def _other_base():
    torch.manual_seed(7)  # the same shapes, other weights: a same-shaped checkpoint of another training
    return nn.Sequential(_adapters.Block(), _adapters.Block())


def test_save_adapter_records_the_base_it_was_trained_on(tmp_path):
    save_adapter(adapted(base_model()), tmp_path, base_model_name_or_path="org/base-7b")
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "org/base-7b"
    from safetensors import safe_open

    with safe_open(tmp_path / ADAPTER_WEIGHTS, framework="pt") as f:
        base = json.loads(f.metadata()["parallel_lora"])["base"]
    # 2 blocks x (q_proj weight + bias, up_proj weight, down_proj weight + bias, head weight + bias)
    assert base["tensors"] == 14 and base["parameters"] == 2 * (156 + 240 + 252 + 156) and len(base["sha256"]) == 64


def test_loading_onto_its_own_base_says_nothing_in_any_float_dtype(tmp_path, capsys):
    base = base_model()
    save_adapter(adapted(base, seed=1), tmp_path)
    capsys.readouterr()
    load_adapter(adapted(base, seed=2), tmp_path)
    half = adapted(base, seed=2)  # the same base loaded in bf16: its values round alike
    for name, p in half.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    load_adapter(half, tmp_path, strict=True)
    assert capsys.readouterr().err == ""


def test_loading_onto_another_base_warns_in_one_line_naming_the_trained_one(tmp_path, capsys):
    save_adapter(adapted(base_model(), seed=1), tmp_path, base_model_name_or_path="org/base-7b")
    capsys.readouterr()
    model = adapted(_other_base(), seed=2)
    load_adapter(model, tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained on 'org/base-7b'" in err and "strict=True" in err, err
    assert torch.equal(model.state_dict()["0.q_proj.lora_B.weight"], adapter_state(adapted(base_model()))[
        "0.q_proj.lora_B.weight"])  # it still loads


def test_strict_refuses_another_base_and_leaves_the_model_unchanged(tmp_path):
    save_adapter(adapted(base_model(), seed=1), tmp_path, base_model_name_or_path="org/base-7b")
    model = adapted(_other_base(), seed=2)
    before = adapter_state(model)
    with pytest.raises(ValueError, match=r"trained on 'org/base-7b'.*load it onto its own base"):
        load_adapter(model, tmp_path, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_merged_model_saves_its_unmerged_bases_fingerprint(tmp_path, capsys):
    base = base_model()
    model = adapted(base, seed=1).eval()
    merge_lora(model)
    save_adapter(model, tmp_path)
    capsys.readouterr()
    load_adapter(adapted(base, seed=2), tmp_path, strict=True)
    assert capsys.readouterr().err == ""


def test_an_adapter_without_a_base_fingerprint_still_loads_onto_any_base(tmp_path, capsys):
    save_adapter(adapted(base_model(), seed=1), tmp_path)
    weights = tmp_path / ADAPTER_WEIGHTS
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        record = json.loads(f.metadata()["parallel_lora"])
    del record["base"]  # as adapters were saved before they recorded their base
    save_file(load_file(weights), weights, metadata={"format": "pt", "parallel_lora": json.dumps(record)})
    capsys.readouterr()
    load_adapter(adapted(_other_base(), seed=2), tmp_path, strict=True)
    assert capsys.readouterr().err == ""
