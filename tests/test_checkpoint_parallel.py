"""Adapter files and training checkpoints across tensor-parallel sizes (gloo, CPU).

Reference: the full tensors the saving run held (``full_tensor()``) and the adapter file itself. A file
saved at tp=2 must load at tp=4 and on one process with the same full tensors; a DCP checkpoint saved at
tp=2 must resume at tp=4 with the same adapters and AdamW moments.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.device_mesh import DeviceMesh

import parallel_lora._checkpoint
from parallel_lora import (
    ColumnParallelLoRALinear,
    LoRAConfig,
    LoRALinear,
    RowParallelLoRALinear,
    latest_checkpoint,
    load_adapter,
    load_checkpoint,
    save_adapter,
    save_checkpoint,
)
from parallel_lora._checkpoint import ADAPTER_WEIGHTS
from tests._dist import mesh, run_ranks

CONFIG = LoRAConfig(r=3, alpha=6, lora_dtype=torch.float32)


class Pair(nn.Module):
    """column ``up`` -> row ``down``, the MLP pattern."""

    def __init__(self, m, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.up = ColumnParallelLoRALinear(8, 16, CONFIG, m)
        self.down = RowParallelLoRALinear(16, 8, CONFIG, m)
        with torch.no_grad():  # B is zero at init: give it values so a wrong load is visible
            for layer in (self.up, self.down):
                b = layer.lora_B.weight
                b.to_local().copy_(torch.randn(b.to_local().shape))

    def forward(self, x):
        return self.down(self.up(x))


def _full_adapters(model):
    return {n: p.detach().full_tensor() for n, p in model.named_parameters() if "lora_" in n}


def _save_adapter_rank(path):
    model = Pair(mesh(), seed=1)
    save_adapter(model, path)
    return _full_adapters(model)


def _load_adapter_rank(path):
    model = Pair(mesh(), seed=2)
    load_adapter(model, path)
    return _full_adapters(model)


def test_adapter_saved_at_tp2_loads_at_tp4_and_on_one_process(tmp_path):
    saved = run_ranks(2, _save_adapter_rank, str(tmp_path))[0]
    file = load_file(tmp_path / ADAPTER_WEIGHTS)
    assert file["base_model.model.up.lora_A.weight"].shape == (3, 8)
    assert file["base_model.model.down.lora_B.weight"].shape == (8, 3)
    for loaded in run_ranks(4, _load_adapter_rank, str(tmp_path)):
        for name, t in saved.items():
            assert torch.equal(loaded[name], t), name
    single = nn.Module()
    single.up, single.down = LoRALinear(8, 16, CONFIG), LoRALinear(16, 8, CONFIG)
    load_adapter(single, tmp_path)
    for name, t in saved.items():
        assert torch.equal(single.get_parameter(name), t), name


def _with_old_dropout_streams(trainable_state):
    """``_trainable_state`` as checkpoints had it when the parallel layers kept a dropout stream, ``[seed, step]``,
    as their extra state."""

    def with_streams(model, optimizer):
        model_state, optim_state = trainable_state(model, optimizer)
        model_state.update({f"{name}._extra_state": torch.tensor([12345, 7]) for name in ("up", "down")})
        return model_state, optim_state

    return with_streams


def _train_and_save_rank(root, old_streams=False):
    model = Pair(mesh(), seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    opt.step()
    trainable_state = parallel_lora._checkpoint._trainable_state
    if old_streams:
        parallel_lora._checkpoint._trainable_state = _with_old_dropout_streams(trainable_state)
    try:
        save_checkpoint(root, model, opt, step=1)
    finally:
        parallel_lora._checkpoint._trainable_state = trainable_state
    moments = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return _full_adapters(model), moments


def _resume_rank(root):
    model = Pair(mesh(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    meta = load_checkpoint(latest_checkpoint(root), model, opt)
    moments = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return meta["step"], _full_adapters(model), moments


@pytest.mark.parametrize("old_streams", [False, True], ids=["now", "with-old-dropout-streams"])
def test_training_checkpoint_saved_at_tp2_resumes_at_tp4(tmp_path, old_streams):
    # A checkpoint that holds the dropout streams the layers once kept (``_extra_state``) loads, the streams ignored.
    adapters, moments = run_ranks(2, _train_and_save_rank, str(tmp_path), old_streams)[0]
    saved = dcp.FileSystemReader(str(latest_checkpoint(tmp_path))).read_metadata().state_dict_metadata
    assert ("model.up._extra_state" in saved) == old_streams, sorted(saved)
    assert any(m.abs().sum() > 0 for m in moments.values())
    for step, got_adapters, got_moments in run_ranks(4, _resume_rank, str(tmp_path)):
        assert step == 1
        for name, t in adapters.items():
            assert torch.equal(got_adapters[name], t), name
        for name, t in moments.items():
            assert torch.equal(got_moments[name], t), name


class SinglePair(nn.Module):
    """``Pair`` of single-device ``LoRALinear``s: the same names, plain tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up, self.down = LoRALinear(8, 16, CONFIG), LoRALinear(16, 8, CONFIG)


def _resume_from_single_rank(root, adapters, moments):
    model = Pair(mesh(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert load_checkpoint(latest_checkpoint(root), model, opt)["step"] == 1
    for name, t in adapters.items():
        assert torch.equal(model.get_parameter(name).full_tensor(), t), name
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), moments[name]), name


def test_training_checkpoint_of_single_device_layers_resumes_on_tp_layers(tmp_path):
    model = SinglePair()
    with torch.no_grad():
        for layer in (model.up, model.down):
            layer.lora_B.weight.normal_()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.down(model.up(torch.randn(4, 8))).square().mean().backward()
    opt.step()
    save_checkpoint(tmp_path, model, opt, step=1)  # one process, no process group
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if p.requires_grad}
    run_ranks(2, _resume_from_single_rank, str(tmp_path), adapters, moments)


def _merge_rank():
    with torch.no_grad():
        return _merge_and_unmerge()


def _merge_and_unmerge():
    from parallel_lora import disable_adapter, merge_lora, unmerge_lora

    model = Pair(mesh(), seed=1)
    model.eval()
    x = torch.randn(5, 8)
    before = model(x)
    weights = {n: m.weight.detach().full_tensor() for n, m in (("up", model.up), ("down", model.down))}
    merge_lora(model)
    merged_out = model(x)
    for name, m in (("up", model.up), ("down", model.down)):
        delta = m.scale * m.lora_B.weight.detach().full_tensor() @ m.lora_A.weight.detach().full_tensor()
        torch.testing.assert_close(m.weight.detach().full_tensor(), weights[name] + delta, atol=1e-6, rtol=1e-6)
    with disable_adapter(model):  # merged: the base GEMM alone already carries the update
        torch.testing.assert_close(model(x), merged_out)
    unmerge_lora(model)
    for name, m in (("up", model.up), ("down", model.down)):
        assert torch.equal(m.weight.detach().full_tensor(), weights[name]), name
    with disable_adapter(model):
        base_out = model(x)
    return before, merged_out, base_out, model(x)


def test_merge_is_local_per_shard_and_unmerge_is_exact_under_tp():
    for before, merged, base, after in run_ranks(2, _merge_rank):
        torch.testing.assert_close(merged, before, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after, before, atol=0, rtol=0)
        assert not torch.allclose(base, before)  # the adapter matters, so the checks above are not vacuous


def _save_bare_column_rank(path):
    torch.manual_seed(1)
    layer = ColumnParallelLoRALinear(8, 16, CONFIG, mesh())
    with torch.no_grad():
        layer.lora_B.weight.to_local().copy_(torch.randn(layer.lora_B.weight.to_local().shape))
    save_adapter(layer, path)
    return {n: p.detach().full_tensor() for n, p in layer.named_parameters() if "lora_" in n}


def _load_bare_row_rank(path):
    layer = RowParallelLoRALinear(16, 8, CONFIG, mesh())  # the transposed shapes: keys match, shapes do not
    try:
        load_adapter(layer, path)
    except ValueError as e:
        return str(e)


def test_a_bare_parallel_layer_saves_and_loads_into_a_bare_single_device_layer(tmp_path):
    saved = run_ranks(2, _save_bare_column_rank, str(tmp_path))[0]
    single = LoRALinear(8, 16, CONFIG)
    load_adapter(single, tmp_path)
    for name, t in saved.items():
        assert torch.equal(single.get_parameter(name), t), name
    assert all("'base_model.model.lora_A.weight' has shape (3, 8), the model expects (3, 16)" in e for e in
               run_ranks(2, _load_bare_row_rank, str(tmp_path)))


def _save_on_rank_0_only(rank: int, init_file: str, path: str, results) -> None:
    # Its own two processes and process group, with a 3 s timeout: a timed-out gloo group is not reused safely,
    # so this stays out of the shared pool. Rank 1 goes on with other work (sleeps) instead of saving.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    model = Pair(DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)), seed=1)
    if rank == 0:
        try:
            save_adapter(model, path)
            results.send("saved")
        except RuntimeError as e:
            results.send(str(e))
    else:
        time.sleep(10)
    os._exit(0)


@pytest.mark.slow
def test_save_adapter_on_rank_0_only_raises_that_every_rank_must_call_it(tmp_path):
    # HF's habit (save_pretrained on rank 0 only) with a collective save: an error within the group's timeout
    # that says every rank must call it, not a hang.
    ctx = mp.get_context("spawn")  # a fork of this process may inherit a lock held by one of its threads
    answer, results = ctx.Pipe(duplex=False)  # send() writes at once: nothing for os._exit to cut off
    procs = [ctx.Process(target=_save_on_rank_0_only, args=(r, str(tmp_path / "store"), str(tmp_path / "adapter"),
                                                             results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert answer.poll(120), "rank 0 neither saved nor raised"
        message = answer.recv()
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert "save_adapter is collective: every rank must call it" in message, message
    assert not (tmp_path / "adapter").exists()


def _resume_rng_rank(root):
    model = Pair(mesh(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(100 + dist.get_rank())  # generators apart before the load: only a restore aligns them
    load_checkpoint(latest_checkpoint(root), model, opt)
    return torch.randint(0, 2**62, (4,))


def test_training_checkpoint_resumed_on_more_ranks_gives_every_rank_rank0s_rng_state(tmp_path):
    # The dropout masks of TP ranks agree only while their generators do: a rank the saving run did not have must
    # not keep its own state while the others restore theirs.
    model = SinglePair()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    save_checkpoint(tmp_path, model, opt, step=1)  # one process: rng_rank0.pt only
    expected = torch.randint(0, 2**62, (4,))
    for rank, drawn in enumerate(run_ranks(2, _resume_rng_rank, str(tmp_path))):
        assert torch.equal(drawn, expected), rank


def _refused_resume_rank(root):
    model = Pair(mesh(), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = _full_adapters(model)
    try:
        load_checkpoint(latest_checkpoint(root), model, opt)
    except ValueError as e:
        message = str(e)
    else:
        message = None
    assert all(torch.equal(t, before[n]) for n, t in _full_adapters(model).items()) and not opt.state
    return message


@pytest.mark.parametrize("name", ["__0_0.distcp", "__1_0.distcp", "rng_rank1.pt"])
def test_every_rank_refuses_a_checkpoint_with_a_flipped_byte_in_any_ranks_file(tmp_path, name):
    # Each rank hashes its share of the files: the verdict must still reach every rank, or they would part ways.
    run_ranks(2, _train_and_save_rank, str(tmp_path))
    file = latest_checkpoint(tmp_path) / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    for message in run_ranks(2, _refused_resume_rank, str(tmp_path)):
        assert message is not None and f"{file} fails its checksum" in message, message


def _single_copy(model):
    """One-process ``LoRALinear``s holding ``model``'s full base weights."""
    single = nn.Module()
    single.up, single.down = LoRALinear(8, 16, CONFIG), LoRALinear(16, 8, CONFIG)
    with torch.no_grad():
        for name in ("up", "down"):
            getattr(single, name).weight.copy_(getattr(model, name).weight.full_tensor())
    return single


def _fingerprint_rank(path):
    from parallel_lora._checkpoint import _base_fingerprint

    model = Pair(mesh(), seed=1)
    if path is not None:
        save_adapter(model, path)
    return _base_fingerprint(model), _base_fingerprint(_single_copy(model))


def test_the_base_fingerprint_is_the_same_at_every_tp_size(tmp_path):
    results = [*run_ranks(2, _fingerprint_rank, str(tmp_path)), *run_ranks(4, _fingerprint_rank, None)]
    assert all(r == results[0] for r in results) and results[0][0] == results[0][1], results
    torch.manual_seed(1)
    own = nn.Module()  # what Pair(seed=1) holds, built on one process
    own.up, own.down = LoRALinear(8, 16, CONFIG), LoRALinear(16, 8, CONFIG)
    load_adapter(own, tmp_path, strict=True)  # saved at tp=2 onto the same base: nothing to refuse
    other = nn.Module()
    other.up, other.down = LoRALinear(8, 16, CONFIG), LoRALinear(16, 8, CONFIG)
    with pytest.raises(ValueError, match="this model's base has the same sizes but other weights"):
        load_adapter(other, tmp_path, strict=True)
