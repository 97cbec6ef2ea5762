"""``parallel_lora.hf``: transformers checkpoints split by their own TP plan and loaded shard by shard (2 ranks, gloo).

References: transformers' ``AutoModelForCausalLM.from_pretrained`` of the same directory (the base logits, with
B = 0), and our model loaded on one device (logits, loss and every adapter gradient, with the same random non-zero
B on both). Checkpoints are tiny random Llama, Mistral, Qwen2 (tied embeddings, q/k/v biases) and Qwen3 (per-head
q/k norms) written by ``save_pretrained`` (``tests/_hf.py``); Llama's is sharded with an index.

Tolerance (fp32 only): ``atol = 1e-5 * max|ref|``, ``rtol = 1e-5``: the split model differs only in summation
order (dots split over ranks and re-summed by one all-reduce). The one-device load must equal transformers' bitwise.
"""

from __future__ import annotations

import time

import pytest
import safetensors
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from parallel_lora import LoRAConfig, save_adapter
from parallel_lora.hf import check_checkpoint, check_tp, from_pretrained
from parallel_lora.layers import fill_global_, lora_modules
from tests import _dist, _hf

transformers = pytest.importorskip("transformers")

ATOL, RTOL = 1e-5, 1e-5
TP = 2
CONFIG = LoRAConfig(r=4, alpha=8, target_modules="all-linear", lora_dtype=torch.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: str(_hf.write_checkpoint(root / arch, arch, sharded=arch == "llama")) for arch in _hf.ARCHS}


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(got, ref, atol=ATOL * ref.abs().max().item(), rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _random_B(model: torch.nn.Module, seed: int = 5) -> None:
    """The same global random B in every LoRA layer of every model (B = 0 would hide the LoRA path)."""
    generator = torch.Generator().manual_seed(seed)
    for _, layer in lora_modules(model):
        fill_global_(layer.lora_B.weight, lambda b: b.normal_(0.0, 0.2, generator=generator))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def _tp_matches_one_device(path: str, adapter_dir: str, config: LoRAConfig) -> None:
    ids = torch.randint(0, _hf.VOCAB, (2, 12))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    one = from_pretrained(path, config, dtype=torch.float32)
    split = from_pretrained(path, config, mesh=_dist.mesh(), dtype=torch.float32)
    projections = [n for n, _ in split.named_parameters() if n.endswith("_proj.weight")]
    assert len(projections) == 7 * _hf.COMMON["num_hidden_layers"]
    for name in projections:  # adapted or not, every linear the plan names is split
        assert isinstance(split.get_parameter(name), DTensor), name
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(one(ids).logits, want), "the one-device load differs from transformers' own"
        _close(split(ids).logits, want, "tp=2 base logits (B = 0)")

    for m in (one, split):
        _random_B(m)
    logits, loss, grads = _step(one, ids)
    got_logits, got_loss, got_grads = _step(split, ids)
    assert not torch.allclose(logits, want, atol=1e-3), "B != 0 must change the logits"
    _close(got_logits, logits, "tp=2 logits")
    _close(got_loss, loss, "tp=2 loss")
    adapted = len(config.target_modules) if isinstance(config.target_modules, tuple) else 7
    assert sorted(got_grads) == sorted(grads) and len(grads) == 2 * adapted * _hf.COMMON["num_hidden_layers"]
    for name, g in got_grads.items():
        assert isinstance(g, DTensor) and g.dtype == torch.float32, name
        _close(g, grads[name], f"{name}.grad")

    # The adapter file holds full tensors: PEFT puts it on transformers' own model and computes our logits.
    save_adapter(split, adapter_dir)
    with torch.no_grad():
        ours = split.eval()(ids).logits
    if dist.get_rank() == 0:
        from peft import PeftModel

        peft_model = PeftModel.from_pretrained(ref, adapter_dir).eval()
        with torch.no_grad():
            _close(ours, peft_model(ids).logits, "PEFT's logits with our adapter")


@pytest.mark.parametrize("arch", _hf.ARCHS)
def test_hf_model_at_tp2_matches_one_device_and_peft_loads_its_adapter(checkpoints, arch, tmp_path):
    _dist.run_ranks(TP, _tp_matches_one_device, checkpoints[arch], str(tmp_path / "adapter"), CONFIG)


def test_linears_left_unadapted_keep_the_torch_styles_of_the_plan(checkpoints, tmp_path):
    # k_proj, o_proj, gate_proj and up_proj run under torch's ColwiseParallel / RowwiseParallel between LoRA layers.
    config = LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"), lora_dtype=torch.float32)
    _dist.run_ranks(TP, _tp_matches_one_device, checkpoints["llama"], str(tmp_path / "adapter"), config)


class _CountingOpen:
    """``safetensors.safe_open`` that counts every byte a rank takes out of the files."""

    read: list[tuple[str, int]] = []

    def __init__(self, *args, **kwargs) -> None:
        self._handle = _REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, key):
        t = self._handle.get_tensor(key)
        self.read.append((key, t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        view, read = self._handle.get_slice(key), self.read

        class _Slice:
            def get_shape(self):
                return view.get_shape()

            def __getitem__(self, index):
                t = view[index]
                read.append((key, t.numel() * t.element_size()))
                return t

        return _Slice()


_REAL_SAFE_OPEN = safetensors.safe_open


def _reads_only_its_shards(path: str) -> None:
    _CountingOpen.read = []
    safetensors.safe_open = _CountingOpen
    try:
        model = from_pretrained(path, CONFIG, mesh=_dist.mesh(), dtype=torch.float32)
    finally:
        safetensors.safe_open = _REAL_SAFE_OPEN
    read = dict(_CountingOpen.read)
    assert len(read) == len(_CountingOpen.read), "a tensor was read twice"
    # Each base tensor exactly once, in its own shard's size (the files are fp32, as the model).
    shards = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()
              if "lora_" not in n and isinstance(p, torch.Tensor) and p.is_floating_point()}
    assert read.keys() == shards.keys(), sorted(read.keys() ^ shards.keys())
    for name, local in shards.items():
        assert read[name] == local.numel() * 4, name
    whole = sum(model.state_dict()[n].numel() * 4 for n in shards)
    assert sum(read.values()) == model.load_report.bytes_read < 0.55 * whole, (sum(read.values()), whole)
    assert model.load_report.checkpoint_bytes == whole
    assert model.load_report.max_slice_bytes == max(read.values())  # the one slice in flight: a shard, not a tensor
    for name in ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert model.get_parameter(name).placements in ((Shard(0),), (Shard(1),)), name


def test_each_rank_reads_only_its_own_shard_of_each_weight(checkpoints):
    _dist.run_ranks(TP, _reads_only_its_shards, checkpoints["llama"])


def _tied_embeddings_stay_tied(path: str) -> None:
    model = from_pretrained(path, CONFIG, mesh=_dist.mesh(), dtype=torch.float32)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embed and embed.placements == (Shard(0),), embed.placements  # vocabulary-parallel, one tensor
    assert "lm_head.weight" not in model.load_report.keys


def test_tied_embeddings_stay_one_vocab_parallel_tensor(checkpoints):
    _dist.run_ranks(TP, _tied_embeddings_stay_tied, checkpoints["qwen2"])


def test_from_pretrained_reads_the_config_and_file_headers_once(checkpoints, monkeypatch):
    import parallel_lora.hf as hf

    reads = []
    files, config = hf.checkpoint_files, transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(hf, "checkpoint_files", lambda *a, **k: reads.append("headers") or files(*a, **k))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: reads.append("config") or
                        config(*a, **k))
    from_pretrained(checkpoints["llama"], CONFIG, dtype=torch.float32)
    assert sorted(reads) == ["config", "headers"]
    reads.clear()
    checked = check_checkpoint(checkpoints["llama"])  # what a launcher checks before start-up
    model = from_pretrained(checked, CONFIG, dtype=torch.float32)
    assert sorted(reads) == ["config", "headers"] and model.load_report.bytes_read > 0


def test_adapters_do_not_depend_on_the_tp_size_or_the_replica(checkpoints):
    def full_A(model):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()
                if "lora_A" in n}

    ones = full_A(from_pretrained(checkpoints["qwen3"], CONFIG, dtype=torch.float32, seed=3))
    for got in _dist.run_ranks(TP, _full_A_at_tp2, checkpoints["qwen3"]):
        assert got.keys() == ones.keys()
        for name, a in got.items():
            assert torch.equal(a, ones[name]), name


def _full_A_at_tp2(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + dist.get_rank())  # the global generator plays no part: ranks differ on purpose
    model = from_pretrained(path, CONFIG, mesh=_dist.mesh(), dtype=torch.float32, seed=3)
    return {n: p.detach().full_tensor() for n, p in model.named_parameters() if "lora_A" in n}


def test_sharded_and_single_file_checkpoints_load_the_same_model(tmp_path):
    ids = torch.randint(0, _hf.VOCAB, (1, 10))
    single = from_pretrained(_hf.write_checkpoint(tmp_path / "single", seed=4), CONFIG, dtype=torch.float32)
    sharded_dir = _hf.write_checkpoint(tmp_path / "sharded", seed=4, sharded=True)
    assert (sharded_dir / "model.safetensors.index.json").is_file() and not (sharded_dir / "model.safetensors").exists()
    sharded = from_pretrained(sharded_dir, CONFIG, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(single(ids).logits, sharded(ids).logits)


def test_default_is_a_bf16_base_with_fp32_adapters_and_fp32_grads(checkpoints):
    model = from_pretrained(checkpoints["mistral"], CONFIG)
    _random_B(model)
    logits, loss, grads = _step(model, torch.randint(0, _hf.VOCAB, (1, 8)))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
    assert grads
    for name, g in grads.items():
        assert model.get_parameter(name).dtype == g.dtype == torch.float32, name
    assert torch.isfinite(loss)


# -- refusals: before any weight is read, in seconds -----------------------------------------------------------


def _remove(folder, *names):
    for name in names:
        (folder / name).unlink()
    return folder


@pytest.mark.parametrize(
    "make, tp, message",
    [
        (lambda d: d / "nowhere", 1, "does not exist"),
        (lambda d: _remove(_hf.write_checkpoint(d / "m"), "config.json"), 1, "has no config.json"),
        (lambda d: _hf.write_checkpoint(d / "m", tokenizer=False), 1, "has no tokenizer"),
        (lambda d: _remove(_hf.write_checkpoint(d / "m"), "model.safetensors"), 1, "no safetensors weights"),
        (lambda d: _remove(_hf.write_checkpoint(d / "m", sharded=True), "model-00002-of-00004.safetensors"), 1,
         "names shard files that are not in"),
        (lambda d: _hf.write_checkpoint(d / "m", num_key_value_heads=1), 2, "num_key_value_heads=1 is not divisible"),
        (lambda d: _hf.write_checkpoint(d / "m", num_attention_heads=2, num_key_value_heads=2), 4,
         "num_attention_heads=2 is not divisible"),
        (lambda d: _hf.write_checkpoint(d / "m", num_key_value_heads=4, intermediate_size=130), 4,
         "intermediate_size=130 is not divisible"),
    ],
    ids=["missing-dir", "no-config", "no-tokenizer", "no-safetensors", "missing-shard", "kv-heads", "heads", "mlp"],
)
def test_check_checkpoint_refuses_with_a_message_that_names_the_problem(tmp_path, make, tp, message):
    path = make(tmp_path)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        check_checkpoint(path, tp)
    assert time.perf_counter() - start < 5.0


def test_architecture_without_a_plan_is_refused_above_tp1(tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=_hf.VOCAB)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        check_tp(config, 2)
    check_tp(config, 1)


def test_plan_value_we_cannot_honour_is_refused_by_entry():
    config = _hf.tiny_config("llama", base_model_tp_plan={"layers.*.mlp.gate_up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match=r"'layers.\*.mlp.gate_up_proj': 'packed_colwise'"):
        check_tp(config, 2)


def test_missing_tensor_or_wrong_shape_is_refused_before_reading(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _hf.write_checkpoint(tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of the model's tensors.*layers.1.mlp.up_proj.weight"):
        from_pretrained(folder, CONFIG)

    folder = _hf.write_checkpoint(tmp_path / "n")
    config = (folder / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 64')
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"shapes differ.*gate_proj.weight: checkpoint \(128, 64\), model \(64, 64\)"):
        from_pretrained(folder, CONFIG)


def _refuses_one_kv_head(path: str) -> str:
    start = time.perf_counter()
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by the tensor-parallel size tp=2"):
        from_pretrained(path, CONFIG, mesh=_dist.mesh())
    return time.perf_counter() - start


def test_from_pretrained_refuses_one_kv_head_at_tp2_in_seconds(tmp_path):
    path = str(_hf.write_checkpoint(tmp_path / "m", num_key_value_heads=1))
    assert max(_dist.run_ranks(TP, _refuses_one_kv_head, path)) < 5.0


def _fsdp2_after_loading(path: str) -> None:
    """Load at (dp, tp), then ``fully_shard`` each decoder layer and the root over dp (torchtitan's order): one step
    gives the loss and, per adapter, the dp-averaged gradient of the same model without FSDP."""
    from torch.distributed.fsdp import fully_shard

    mesh = _dist.mesh((2, TP), ("dp", "tp"))
    plain = from_pretrained(path, CONFIG, mesh=mesh, dtype=torch.float32)
    sharded = from_pretrained(path, CONFIG, mesh=mesh, dtype=torch.float32)
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(sharded, mesh=mesh["dp"])
    for m in (plain, sharded):
        _random_B(m)
    ids = torch.randint(0, _hf.VOCAB, (2, 12), generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    _, loss, grads = _step(plain, ids)
    _, got_loss, got_grads = _step(sharded, ids)
    _close(got_loss, loss, "loss under FSDP2")
    for name, g in grads.items():
        local = g.to_local()
        dist.all_reduce(local, group=mesh["dp"].get_group())
        local /= 2
        _close(got_grads[name], g.full_tensor(), f"{name}.grad under FSDP2")


def test_fsdp2_over_dp_after_loading_averages_like_the_dp_all_reduce(checkpoints):
    _dist.run_ranks(2 * TP, _fsdp2_after_loading, checkpoints["llama"])


def _checkpointed_step_is_bitwise(path: str) -> None:
    """transformers' own activation checkpointing (non-reentrant) reruns our layers, dropout masks included."""
    config = LoRAConfig(r=4, alpha=8, target_modules="all-linear", lora_dtype=torch.float32, dropout=0.1)
    ids = torch.randint(0, _hf.VOCAB, (2, 12))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the masks' seeds come from the generator: both runs start from one state
        model = from_pretrained(path, config, mesh=_dist.mesh(), dtype=torch.float32)
        _random_B(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        results.append(_step(model, ids))
    (_, loss, grads), (_, got_loss, got_grads) = results
    assert torch.equal(got_loss, loss)
    for name, g in grads.items():
        assert torch.equal(got_grads[name].full_tensor(), g.full_tensor()), name


def test_activation_checkpointing_of_transformers_reruns_the_layers_bit_for_bit(checkpoints):
    _dist.run_ranks(TP, _checkpointed_step_is_bitwise, checkpoints["llama"])
