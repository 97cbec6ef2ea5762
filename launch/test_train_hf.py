"""End-to-end tests of ``launch/train.py --model DIR --data FILE``: ``torchrun`` subprocesses on CPU/gloo.

Checkpoints are tiny random Llama and Qwen2 models (``tests/_hf.py``; Qwen2 with tied embeddings and q/k/v biases),
the data a prompt/completion ``.jsonl`` whose completions are a fixed function of the prompt, so 20 steps of
adapters clearly lower the loss. Each run is the issue's command at tp = 2 with small batches. References: PEFT on
transformers' own model of the same directory (the adapter must give our logits), a one-device recomputation of
the logged losses, and the uninterrupted run for a resumed one (bit for bit). Refusals must come within seconds,
naming the problem, before any weight is read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from parallel_lora import LoRAConfig, load_adapter
from tests import _hf
from tests._procs import check_ok

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
from launch import cli  # noqa: E402
from launch.data import IGNORE_INDEX, PackedData, generate_corpus, load_tokenizer  # noqa: E402
from launch.model import Transformer, config_for  # noqa: E402
from launch.train import TARGET_MODULES, forward  # noqa: E402
from parallel_lora.hf import from_pretrained  # noqa: E402

STEPS = 20
# A random tiny checkpoint learns in 20 steps only at the toy model's rate, not at the default for real checkpoints.
SMALL = ["--batch-size", "4", "--seq-len", "32", "--eval-every", "5", "--save-every", "10", "--dropout", "0.1",
         "--lr", "1e-2"]
# Per architecture: Qwen2 also trains under bf16 autocast.
EXTRA = {"llama": [], "qwen2": ["--autocast"]}
THINGS = ["lamp", "key", "bell", "boat", "coat", "book", "cart", "basket", "letter", "loaf"]
PLACES = ["market", "forest", "garden", "hill", "meadow", "bridge", "harbour", "river", "village"]


def write_questions(path: Path, n: int = 200) -> Path:
    """``n`` prompt/completion lines whose answer is a fixed function of the question (words in the tokenizer)."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        i = rng.randrange(len(THINGS))
        rows.append({"prompt": f"Where is my {THINGS[i]}", "completion": f"It is by the {PLACES[i % len(PLACES)]} ."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_mixed(path: Path, n: int = 120) -> Path:
    """Plain sentences (an empty prompt) among long prompts with short completions: windows whose target counts differ
    several-fold, where a mean of per-batch means would differ from the mean over targets."""
    sentences = generate_corpus(6000, seed=2).replace("\n\n", " ").split(". ")
    rows = [{"prompt": "", "completion": sentences[i] + "."} if i % 3 == 0 else
            {"prompt": " ".join(sentences[i : i + 3]), "completion": "It is by the hill ."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_hf")
    return {
        "llama": _hf.write_checkpoint(root / "llama", "llama"),
        "qwen2": _hf.write_checkpoint(root / "qwen2", "qwen2"),
        "one_kv_head": _hf.write_checkpoint(root / "one_kv_head", "llama", num_key_value_heads=1),
        "no_tokenizer": _hf.write_checkpoint(root / "no_tokenizer", "llama", tokenizer=False),
        "data": write_questions(root / "questions.jsonl"),
        "mixed": write_mixed(root / "mixed.jsonl"),
    }


def torchrun(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "launch" / "train.py"), "--output-dir", str(out_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def run_args(files: dict[str, Path], arch: str) -> list[str]:
    return ["--model", str(files[arch]), "--data", str(files["data"]), "--steps", str(STEPS), *SMALL, *EXTRA[arch]]


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory) -> dict[str, Path]:
    outs = {}
    for arch in EXTRA:
        outs[arch] = tmp_path_factory.mktemp(f"run_{arch}")
        check_ok(torchrun(outs[arch], *run_args(files, arch)))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(EXTRA))
def test_model_run_lowers_the_train_and_eval_loss(runs, arch):
    rows = metrics(runs[arch])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10, 15, 20]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.1 and evals == sorted(evals, reverse=True), evals  # held-out tokens: slower
    assert (runs[arch] / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (runs[arch] / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]


def _ours(model_dir: Path, adapter: Path | None, dtype: torch.dtype) -> torch.nn.Module:
    model = from_pretrained(model_dir, LoRAConfig(r=8, alpha=16, target_modules=TARGET_MODULES,
                                                  lora_dtype=torch.float32), dtype=dtype)
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(EXTRA))
def test_model_adapter_loads_into_peft_with_our_logits(runs, files, arch):
    adapter = runs[arch] / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    ids = torch.randint(4, _hf.VOCAB, (2, 16))
    # fp32: the same math on the same tensors; bf16 (the run's base): within a bf16 rounding of the outputs.
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        base = transformers.AutoModelForCausalLM.from_pretrained(files[arch], dtype=dtype)
        with torch.no_grad():
            base_logits = base(ids).logits.float()
            theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits.float()
            ours = _ours(files[arch], adapter, dtype)(ids, use_cache=False).logits.float()
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        assert (theirs - base_logits).abs().max() > 0.2, "the trained adapter must change the logits"


def _mean_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs, use_cache=False).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += int((targets != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.slow
def test_model_losses_are_the_mean_over_completion_tokens(runs, files):
    # Step 1 trains from B = 0: its loss is the base's on that step's batch, prompts masked. The last eval loss
    # is the trained model's on every held-out window. Recomputed on one device (tp = 2 sums in another order).
    rows = metrics(runs["llama"])
    data = PackedData(files["data"], load_tokenizer(files["llama"]), seq_len=32, eval_fraction=0.05)
    first = data.batch(seed=0, step=1, micro_step=0, batch_size=4, seq_len=32)
    assert (first[1] == IGNORE_INDEX).any() and (first[1] != IGNORE_INDEX).any()
    assert _mean_loss(_ours(files["llama"], None, torch.bfloat16), [first]) == pytest.approx(rows[0]["loss"], rel=1e-2)
    trained = _ours(files["llama"], runs["llama"] / "adapter", torch.bfloat16)
    assert _mean_loss(trained, data.eval_batches(4)) == pytest.approx(rows[-1]["eval_loss"], rel=1e-2)


@pytest.mark.slow
def test_model_resume_with_activation_checkpointing_reproduces_the_run(runs, files, tmp_path):
    # The run as if stopped after its step-10 checkpoint, resumed with transformers' activation checkpointing on:
    # the same batches, optimizer state, dropout masks (rerun in backward) and ops, so the same numbers bit for bit.
    out = tmp_path / "resumed"
    shutil.copytree(runs["llama"], out)
    shutil.rmtree(out / "checkpoints" / "step_00000020")
    resumed = torchrun(out, *run_args(files, "llama"), "--resume", "--activation-checkpointing")
    check_ok(resumed)
    assert "step_00000010 at step 10" in resumed.stdout, resumed.stdout

    def numbers(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert numbers(metrics(out)) == numbers(metrics(runs["llama"]))
    ours, want = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (out, runs["llama"]))
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)


@pytest.mark.slow
def test_model_data_parallel_matches_one_process_on_the_same_global_batch(files, tmp_path):
    # dp = 2 at tp = 1 (plain-tensor adapters) with accumulation, on windows whose target counts differ several-fold
    # between ranks and micro-batches (a mean of their means is off by ~3e-3), and 5 eval windows split 3 + 2 over
    # dp. Without dropout: each dp replica draws its own masks. The same global batches: the same losses up to the
    # bf16 base's rounding (~4e-5 measured).
    args = ["--model", str(files["llama"]), "--data", str(files["mixed"]), "--steps", "4", "--seq-len", "32",
            "--grad-accum", "2", "--eval-every", "2", "--save-every", "100"]
    dp2, one = tmp_path / "dp2", tmp_path / "one"
    check_ok(torchrun(dp2, *args, "--dp", "2", "--tp", "1", "--batch-size", "2"))
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--output-dir", str(one), *args, "--batch-size", "4"]
    check_ok(subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300))
    for key in ("loss", "eval_loss"):
        got, want = ([r[key] for r in metrics(d) if key in r] for d in (dp2, one))
        assert len(want) == (4 if key == "loss" else 2)
        assert got == pytest.approx(want, rel=3e-4), key


def _refused_in_seconds(out: Path, *args: str) -> str:
    start = time.monotonic()
    proc = torchrun(out, *args, "--steps", "2")
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert took < 20, f"refused after {took:.0f} s"
    assert not out.exists(), "nothing may start"
    return proc.stderr


@pytest.mark.slow
def test_tp_that_splits_a_key_value_head_is_refused_in_seconds(files, tmp_path):
    err = _refused_in_seconds(tmp_path / "run", "--model", str(files["one_kv_head"]), "--data", str(files["data"]))
    line = "train.py: error: --model: num_key_value_heads=1 is not divisible by the tensor-parallel size tp=2"
    assert err.count(line) == 1, err


@pytest.mark.slow
def test_a_missing_model_is_refused_in_seconds(files, tmp_path):
    missing = tmp_path / "no-such-model"
    err = _refused_in_seconds(tmp_path / "run", "--model", str(missing), "--data", str(files["data"]))
    assert err.count(f"train.py: error: --model: model path {missing} does not exist") == 1, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "{data}"], "--data needs --model DIR"),
        (["--model", "{llama}"], "--model needs --data FILE"),
        (["--model", "{llama}", "--data", "{data}", "--preset", "tiny"], "--preset sizes the built-in toy model"),
        (["--eval-every", "5"], "--eval-every needs --model and --data"),
        (["--model", "{llama}", "--data", "{data}", "--sequence-parallel"],
         "--sequence-parallel is not supported with --model"),
        (["--model", "{llama}", "--data", "{data}", "--eval-every", "-1"], "--eval-every must be >= 0"),
        (["--model", "{llama}", "--data", "{data}", "--eval-fraction", "1"], "--eval-fraction must be in [0, 1)"),
        (["--model", "{llama}", "--data", "{tmp}/none.jsonl"], "none.jsonl does not exist"),
        (["--model", "{llama}", "--data", "{llama}/config.json"], "expected a .jsonl or .txt file, got '.json'"),
        (["--model", "{no_tokenizer}", "--data", "{data}"], "no_tokenizer has no tokenizer"),
        (["--model", "{llama}", "--data", "{data}", "--seq-len", "512"],
         "--seq-len must be <= 256, the model's max_position_embeddings"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_model_flags_are_checked_before_anything_starts(files, tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    names = {k: str(v) for k, v in files.items()} | {"tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--output-dir", str(tmp_path / "run"), *(f.format(**names) for f in flags)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_resume_of_a_model_run_on_the_toy_model_is_refused(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "run"
    shutil.copytree(runs["llama"], out, ignore=shutil.ignore_patterns("adapter", "loss.png"))
    with pytest.raises(SystemExit):
        cli.parse_args(["--output-dir", str(out), "--resume", "--preset", "tiny"])
    err = capsys.readouterr().err
    assert "step_00000020 was saved by a run on --model " in err
    assert "do not fit a run on the built-in 'tiny' toy model" in err


def test_autocast_runs_the_forward_in_bf16():
    torch.manual_seed(0)
    model = Transformer(config_for("tiny", vocab_size=43))
    ids = torch.randint(0, 43, (2, 8))
    assert forward(model, ids, Namespace(model=None, autocast=False)).dtype == torch.float32
    assert forward(model, ids, Namespace(model=None, autocast=True)).dtype == torch.bfloat16


def test_lr_defaults_to_the_toy_models_rate_or_a_lora_rate_for_a_checkpoint(files, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    toy = cli.parse_args(["--output-dir", str(tmp_path / "toy")])
    model = cli.parse_args(["--output-dir", str(tmp_path / "hf"), "--model", str(files["llama"]), "--data",
                            str(files["data"])])  # fmt: skip
    given = cli.parse_args(["--output-dir", str(tmp_path / "hf"), "--model", str(files["llama"]), "--data",
                            str(files["data"]), "--lr", "1e-3"])  # fmt: skip
    assert (toy.lr, model.lr, given.lr) == (cli.DEFAULT_LR, cli.DEFAULT_MODEL_LR, 1e-3) == (1e-2, 2e-4, 1e-3)
