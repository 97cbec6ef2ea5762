"""End-to-end tests of ``launch/train.py``: real ``torchrun`` subprocesses on CPU/gloo, 'tiny' preset.

The reference is run A, one uninterrupted 2-rank (tp=2) run. Every other run is compared with it (or with
a single-rank run) step by step through ``metrics.jsonl``. Losses are compared exactly where the two runs
execute the same ops in the same order (a resumed run), and within fp32 rounding where a collective
changes the order of a sum (sequence parallelism, data parallelism).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import parallel_lora as pl
from launch.data import CORPUS_PATH, Corpus, generate_corpus
from launch.model import Transformer, check_tp, config_for
from launch.train import TARGET_MODULES, keep_metrics_until, replica_seed, rng_source
from tests._procs import check_ok

REPO = Path(__file__).resolve().parents[1]

STEPS = 8
# Dropout on, so resume must also restore each rank's RNG state (the masks' seeds are drawn from it).
COMMON = ["--preset", "tiny", "--steps", str(STEPS), "--save-every", "3", "--batch-size", "4", "--seq-len", "64",
          "--dropout", "0.1", "--seed", "0"]


def torchrun(out_dir: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "launch" / "train.py"), "--output-dir", str(out_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def launch_one(out_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python launch/train.py``, without torchrun: a world of one."""
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--output-dir", str(out_dir), *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def losses(out_dir: Path) -> list[float]:
    return [row["loss"] for row in metrics(out_dir)]


def check_resumed(proc: subprocess.CompletedProcess, out: Path, at: str) -> None:
    """A ``--resume`` run that exited 0, said it resumed ``at`` (e.g. "at step 3") and logged every step once."""
    check_ok(proc)
    assert "resuming from" in proc.stdout and at in proc.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))  # no step logged twice


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run_a")
    check_ok(torchrun(out, *COMMON))
    return out


@pytest.mark.slow
def test_run_writes_one_metrics_line_per_step(run_a):
    rows = metrics(run_a)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {"step", "loss", "tokens_per_s", "lr"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["lr"] > 0
    assert (run_a / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_loss_falls(run_a):
    values = losses(run_a)
    assert values[-1] < values[0] - 0.1, values


@pytest.mark.slow
def test_checkpoints_are_complete_and_on_schedule(run_a):
    names = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000006", "step_00000008"]  # every 3 steps and the last
    assert pl.latest_checkpoint(run_a / "checkpoints").name == "step_00000008"


def _fresh_model() -> tuple[Transformer, Corpus]:
    corpus = Corpus()
    torch.manual_seed(0)  # the launcher's --seed: the same frozen base
    return Transformer(config_for("tiny", vocab_size=corpus.tokenizer.vocab_size)), corpus


def _loss(model: Transformer, corpus: Corpus) -> float:
    x, y = corpus.batch(seed=123, step=0, micro_step=0, batch_size=8, seq_len=64)
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


@pytest.mark.slow
def test_adapter_loads_into_a_fresh_model_and_lowers_its_loss(run_a):
    adapter = run_a / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    model, corpus = _fresh_model()
    base_loss = _loss(model, corpus)
    pl.apply_lora(model, pl.LoRAConfig(r=8, alpha=16, target_modules=TARGET_MODULES), verbose=False)
    pl.load_adapter(model, adapter)
    model.eval()
    assert model.layers[0].attn.q_proj.lora_B.weight.abs().sum() > 0  # trained B, not the zero init
    assert _loss(model, corpus) < base_loss - 0.1


@pytest.mark.slow
def test_adapter_loads_into_peft_with_the_same_outputs(run_a):
    peft = pytest.importorskip("peft")
    ours, corpus = _fresh_model()
    pl.apply_lora(ours, pl.LoRAConfig(r=8, alpha=16, target_modules=TARGET_MODULES), verbose=False)
    pl.load_adapter(ours, run_a / "adapter")
    base, _ = _fresh_model()
    theirs = peft.PeftModel.from_pretrained(base, run_a / "adapter")
    x, _ = corpus.batch(seed=1, step=0, micro_step=0, batch_size=2, seq_len=32)
    with torch.no_grad():
        # Same eager math on the same tensors; only the summation order of the LoRA branch may differ.
        torch.testing.assert_close(theirs.eval()(x), ours.eval()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_resume_after_a_rank_dies_reproduces_the_uninterrupted_run(run_a, tmp_path):
    out = tmp_path / "run_b"
    crashed = torchrun(out, *COMMON, "--fail-at-step", "5", "--fail-rank", "1")
    assert crashed.returncode != 0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]  # died inside step 5, before logging it
    root = out / "checkpoints"
    # A save torn by a crash: only its .tmp directory exists. It must never be picked as the latest.
    torn = root / "step_00000007.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    latest = pl.latest_checkpoint(root)
    assert latest.name == "step_00000003"
    assert {"meta.json", ".complete", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in latest.iterdir()}

    resumed = torchrun(out, *COMMON, "--resume")
    check_resumed(resumed, out, "at step 3")
    # Same batches (a function of seed and step), same optimizer state, same dropout masks: bit-exact.
    assert losses(out) == losses(run_a)


@pytest.mark.slow
def test_resume_at_a_larger_tp_draws_the_uninterrupted_runs_masks(run_a, tmp_path):
    # Saved at tp=2, resumed at tp=4: ranks 2 and 3 saved no RNG state, and must draw the masks ranks 0 and 1 draw.
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    resumed = torchrun(out, *COMMON, "--resume", nproc=4)
    check_resumed(resumed, out, "at step 6")
    # The same masks, sums over 4 shards instead of 2: fp32 rounding apart (another mask moves the loss far more).
    torch.testing.assert_close(losses(out), losses(run_a), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_losses(run_a, tmp_path):
    out = tmp_path / "run_ac"
    check_ok(torchrun(out, *COMMON, "--activation-checkpointing"))
    # Each block reruns its forward in backward with the masks its forward drew: the same ops on the same
    # values, so the same losses bit for bit (dropout is on in COMMON).
    assert losses(out) == losses(run_a)


@pytest.mark.slow
def test_sequence_parallel_gives_the_same_losses(run_a, tmp_path):
    out = tmp_path / "run_sp"
    check_ok(torchrun(out, *COMMON, "--sequence-parallel"))
    # Reduce-scatter instead of all-reduce: the same two-term sums, so agreement to fp32 rounding.
    torch.testing.assert_close(losses(out), losses(run_a), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_data_parallel_matches_one_rank_on_the_same_global_batch(tmp_path):
    # Without dropout: each dp rank draws masks for its own local rows, so masks differ from one rank's.
    args = ["--preset", "tiny", "--steps", "4", "--seq-len", "64", "--dropout", "0", "--save-every", "100"]
    single, dp2 = tmp_path / "single", tmp_path / "dp2"
    check_ok(torchrun(single, *args, "--batch-size", "4", nproc=1))
    check_ok(torchrun(dp2, *args, "--batch-size", "2", "--dp", "2", "--tp", "1"))
    # The dp all-reduce averages two half-batch means: equal to the full mean up to fp32 rounding.
    torch.testing.assert_close(losses(dp2), losses(single), rtol=1e-5, atol=1e-6)


def test_heads_not_divisible_by_tp_raise_a_clear_error():
    with pytest.raises(ValueError, match=r"n_heads=4 must be divisible by the tensor-parallel size tp=3"):
        check_tp(config_for("tiny"), 3)


def test_batches_depend_only_on_seed_step_and_micro_step():
    corpus = Corpus()
    kw = {"seed": 0, "step": 5, "micro_step": 1, "seq_len": 32}
    x, y = corpus.batch(**kw, batch_size=4)
    again, _ = corpus.batch(**kw, batch_size=4)
    assert torch.equal(x, again)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    halves = [corpus.batch(**kw, batch_size=2, dp_rank=d, dp=2)[0] for d in range(2)]
    assert torch.equal(torch.cat(halves), x)  # dp ranks split one global batch
    assert not torch.equal(corpus.batch(**{**kw, "step": 6}, batch_size=4)[0], x)


def test_replica_seed_gives_replicas_their_own_masks_and_tp_ranks_of_one_replica_the_same():
    # A single-device LoRALinear (what --model keeps at tp = 1) adds no offset of its own to its dropout seeds.
    layer = pl.LoRALinear(16, 8, pl.LoRAConfig(r=2, dropout=0.5, target_modules="all-linear")).train()
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(4, 16)

    def output(dp_rank: int) -> torch.Tensor:
        torch.manual_seed(replica_seed(0, dp_rank))
        return layer(x).detach()

    assert torch.equal(output(0), output(0)) and torch.equal(output(1), output(1))
    assert not torch.equal(output(0), output(1))


@pytest.mark.parametrize(("saved", "rank", "dp_rank", "source"), [
    ({"dp": 1, "tp": 2}, 3, 0, 0),  # tp 2 -> 4: every rank of the one replica takes its first rank's state
    ({"dp": 2, "tp": 2}, 5, 1, 2),  # (2, 2) -> (2, 4): replica 1's ranks take saved rank 2's, not rank 5's
    ({"dp": 1, "tp": 2}, 2, 1, None),  # dp 1 -> 2: replica 1 did not exist, it is seeded afresh
    ({"dp": 1}, 3, 0, 3),  # a checkpoint without its tp: each rank its own
])
def test_rng_source_maps_each_rank_to_its_replica_in_the_saved_layout(saved, rank, dp_rank, source):
    assert rng_source(saved, rank, dp_rank) == source


def test_keep_metrics_until_leaves_the_old_file_whole_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    before = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    path.write_text(before)
    real_open = io.open

    class Full(io.FileIO):
        def write(self, data):
            raise OSError(28, "No space left on device")

    def failing_open(file, mode="r", *args, **kwargs):
        # The file is opened (and truncated) for real, then its first write fails: a crash mid-write.
        if "w" in mode:
            real_open(file, mode, *args, **kwargs).close()
            return Full(file, "w")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", failing_open)
    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(OSError, match="No space left"):
        keep_metrics_until(path, 2)
    monkeypatch.undo()
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left behind
    keep_metrics_until(path, 2)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_shipped_corpus_is_the_generator_output():
    assert CORPUS_PATH.read_text(encoding="utf-8") == generate_corpus()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_and_a_resume_on_one_node_of_one_process_continues(run_a, tmp_path):
    # Two torchrun agents meet at one c10d rendezvous, as two machines would (--nnodes 2, one process each), with
    # the command line a preemptible job repeats: --resume from the first launch on. The "node" holding rank 1
    # dies at step 5; the job resumes on one node of one process (tp 2 -> 1: DCP reshards).
    out = tmp_path / "run"
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-nodes"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, str(REPO / "launch" / "train.py"),
           "--output-dir", str(out), "--resume", *COMMON, "--fail-at-step", "5", "--fail-rank", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    both = "".join(outputs)
    assert both.count(f"resume: no checkpoint in {out / 'checkpoints'}, starting at step 0") == 1, both
    failed = [line for line in both.splitlines() if line.startswith("[rank 0] the ")]
    assert len(failed) == 1 and "of step 5 failed: another rank closed its connection (it died)" in failed[0], both
    assert f"(last checkpoint: {out / 'checkpoints' / 'step_00000003'})" in failed[0]
    # Two nodes train like one: tp=2 either way, the same ops, so the same losses bit for bit.
    assert losses(out) == losses(run_a)[:4]

    resumed = launch_one(out, "--resume", *COMMON)
    check_resumed(resumed, out, "step_00000003 at step 3")
    # tp=1 after tp=2: the same masks (rank 0's RNG state is checkpointed), sums in another order.
    torch.testing.assert_close(losses(out), losses(run_a), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_config_yaml_holds_the_run_and_resume_warns_per_changed_setting(run_a, tmp_path):
    settings = yaml.safe_load((run_a / "config.yaml").read_text())
    assert settings["steps"] == STEPS and settings["tp"] == 2 and settings["dropout"] == 0.1
    assert "resume" not in settings and "nproc-per-node" not in settings
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    resumed = launch_one(out, *COMMON, "--resume", "--timeout", "100")
    check_ok(resumed)
    config = out / "config.yaml"
    warnings = [line for line in resumed.stdout.splitlines() if line.startswith("warning: resuming with")]
    assert warnings == [f"warning: resuming with --tp 1, was 2 in {config}",
                        f"warning: resuming with --timeout 100.0, was 300.0 in {config}"], resumed.stdout
    assert yaml.safe_load(config.read_text()) == {**settings, "tp": 1, "timeout": 100.0, "output-dir": str(out)}
    again = launch_one(out, *COMMON, "--resume", "--lr", "0.02", "--steps", str(STEPS + 1))
    check_ok(again)
    assert f"warning: resuming with --lr 0.02, was 0.01 in {config}: losses will differ from the uninterrupted run" \
        in again.stdout


@pytest.mark.slow
def test_resume_with_another_lora_rank_is_refused_in_one_line(run_a, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    refused = launch_one(out, *COMMON, "--resume", "--rank", "4")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr  # no traceback, no CheckpointException
    assert f"{out / 'checkpoints' / 'step_00000008'} was saved with --rank 8" in refused.stderr
    assert "a run with --rank 4" in refused.stderr
    assert metrics(out) == metrics(run_a)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["__1_0.distcp", "meta.json"])
def test_resume_from_a_checkpoint_with_a_flipped_byte_is_refused_in_one_line(run_a, tmp_path, name):
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    file = out / "checkpoints" / "step_00000008" / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    refused = torchrun(out, *COMMON, "--resume", "--steps", "10")
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(errors) == 1 and f"{file} fails its checksum" in errors[0], refused.stderr
    assert f"Delete {file.parent} to resume from the checkpoint before it" in errors[0]
    # One line from rank 0 (torchrun's summary of the failed job quotes it); nothing trained.
    assert "Traceback" not in refused.stderr.split("train.py: error: ")[0] and metrics(out) == metrics(run_a)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_resume_sweeps_the_temporaries_of_killed_writes_and_nothing_else(run_a, tmp_path):
    from parallel_lora._files import HOST

    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    dead, live = f"{_dead_pid()}@{HOST}", f"{os.getppid()}@{HOST}"
    stale = [".adapter.new-1b98858e", f".metrics.jsonl.new-0000000a-{dead}", "checkpoints/step_00000009.tmp",
             f"checkpoints/step_00000009.tmp-{dead}"]  # the untagged two: names from before writers were tagged
    kept = [f".adapter.new-0000000b-{live}", "checkpoints/step_00000010.tmp-1@elsewhere", "notes.txt"]
    for name in stale + kept:
        path = out / name
        if name.endswith(".txt") or "metrics" in name:
            path.write_text("partial")
        else:
            path.mkdir()
            (path / "part").write_bytes(b"partial")
    resumed = launch_one(out, *COMMON, "--resume")
    check_ok(resumed)
    swept = [line for line in resumed.stdout.splitlines() if line.startswith("removed ")]
    assert len(swept) == 1 and all(name in swept[0] for name in stale), resumed.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["adapter", "checkpoints", "config.yaml", "loss.png", "metrics.jsonl", *(n for n in kept if "/" not in n)])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000003", "step_00000006", "step_00000008", "step_00000010.tmp-1@elsewhere"]


@pytest.mark.slow
def test_an_earlier_run_is_kept_unless_overwrite_and_no_matplotlib_only_skips_the_plot(run_a, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refused = launch_one(out, *COMMON)  # the same command again, without --resume
    assert refused.returncode == 2
    assert "holds an earlier run (checkpoints, metrics.jsonl, adapter, loss.png, config.yaml): pass --resume to " \
           "continue it, --overwrite to replace it" in refused.stderr
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # --overwrite replaces it, here on a machine without matplotlib (the [train] extra): the run still succeeds.
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    (out / "notes.txt").write_text("not the launcher's")
    replaced = launch_one(out, *COMMON, "--steps", "2", "--overwrite", env={"PYTHONPATH": str(blocker.parent)})
    check_ok(replaced)
    assert "warning: matplotlib is not installed, so" in replaced.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert not (out / "loss.png").exists() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "notes.txt").read_text() == "not the launcher's"
