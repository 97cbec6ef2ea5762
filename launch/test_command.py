"""``parallel-lora`` (``launch/command.py``) and ``--config``, as a user runs them.

Reference: the command's contract in docs/launcher.md. The command runs as ``python -m launch.command`` (what the
console script calls) in subprocesses on CPU/gloo, on ``launch/tiny_checkpoint.py``'s checkpoint and chat file: it
starts the processes itself, checks flags before any starts, and ends a failure in at most five lines on stderr.
``--config`` is checked in process through ``cli.parse_args``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch import cli, command, tiny_checkpoint
from tests._procs import check_ok

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def parallel_lora(*args: str, cwd: Path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    cmd = [sys.executable, *(launcher or []), "-m", "launch.command", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_checkpoint.write_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def chat_run(tiny, tmp_path_factory) -> Path:
    """The issue's command: two processes on the chat file, 6 steps."""
    cwd = tmp_path_factory.mktemp("chat_run")
    check_ok(parallel_lora("train", "--nproc-per-node", "2", "--model", str(tiny), "--data", str(tiny / "chat.jsonl"),
                           "--steps", "6", "--seq-len", "64", "--output-dir", "out", cwd=cwd))
    return cwd / "out"


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train", "generate"])
def test_help_exits_0(name, tmp_path):
    proc = parallel_lora(name, "--help", cwd=tmp_path)
    check_ok(proc)
    assert "--nproc-per-node N" in proc.stdout and proc.stdout.startswith(f"usage: parallel-lora {name}")


@pytest.mark.slow
def test_a_missing_data_file_exits_2_with_one_line_naming_it(tiny, tmp_path):
    proc = parallel_lora("train", "--nproc-per-node", "2", "--model", str(tiny), "--data", "chat.jsonl",
                         "--output-dir", "out", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["parallel-lora train: error: --data chat.jsonl does not exist (see --help)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_processes_train_on_chat_data_and_write_config_and_adapter(chat_run):
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (chat_run / "adapter").iterdir()}
    settings = yaml.safe_load((chat_run / "config.yaml").read_text())
    assert settings["tp"] == 2 and settings["steps"] == 6 and settings["data"].endswith("chat.jsonl")
    steps = [json.loads(line)["step"] for line in (chat_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_generate_completes_a_prompt_with_the_trained_adapter(chat_run, tiny):
    proc = parallel_lora("generate", "--model", str(tiny), "--adapter", str(chat_run / "adapter"), "--prompt", "hi",
                         "--max-new-tokens", "5", cwd=chat_run)
    check_ok(proc)
    assert proc.stdout.splitlines()[0] == "prompt:  hi" and proc.stdout.splitlines()[1].startswith("adapter:")


@pytest.mark.slow
def test_config_file_and_a_flag_both_apply_the_flag_winning(tiny, tmp_path):
    (tmp_path / "run.yaml").write_text(f"model: {tiny}\ndata: {tiny / 'chat.jsonl'}\nsteps: 10\nseq_len: 32\n"
                                       "output-dir: out\neval-every: 0\n")
    check_ok(parallel_lora("train", "--config", "run.yaml", "--steps", "3", cwd=tmp_path))
    settings = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert (settings["steps"], settings["seq-len"], settings["eval-every"], settings["tp"]) == (3, 32, 0, 1)
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_a_refusal_found_after_start_up_exits_2_with_its_one_line(tiny, tmp_path):
    # A tokenizer without a chat template is found once the ranks load it: rank 0's message, once, and nothing else.
    (tmp_path / "chat.jsonl").write_text((tiny / "chat.jsonl").read_text())
    model = tmp_path / "no-template"
    model.mkdir()
    for f in tiny.iterdir():
        if f.name not in ("chat_template.jinja", "chat.jsonl"):
            (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    proc = parallel_lora("train", "--nproc-per-node", "2", "--model", str(model), "--data", "chat.jsonl",
                         "--output-dir", "out", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f'parallel-lora train: error: --data: chat.jsonl holds "messages" lines, and the tokenizer in {model} has no '
        "chat template to render them: pass --chat-template FILE (a Jinja template)"], proc.stderr


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job_in_a_few_lines_naming_it_and_the_logs(tmp_path):
    proc = parallel_lora("train", "--nproc-per-node", "2", "--preset", "tiny", "--seq-len", "32", "--batch-size", "2",
                         "--steps", "6", "--fail-at-step", "3", "--fail-rank", "1", "--output-dir", "out", cwd=tmp_path)
    assert proc.returncode == 1
    # Rank 0's progress bar came first, on this terminal; the failure is the report at the end.
    lines = [line for line in proc.stderr.splitlines() if line.startswith("parallel-lora train: ")]
    assert 2 <= len(lines) <= 5 and proc.stderr.splitlines()[-len(lines) :] == lines, proc.stderr
    assert not any(noise in proc.stderr for noise in ("Traceback", "ChildFailedError", "OMP_NUM_THREADS"))
    assert any("rank 1" in line for line in lines), proc.stderr
    assert lines[-1].startswith("parallel-lora train: logs of every rank: ")
    logs = Path(lines[-1].rsplit(": ", 1)[1])
    assert "injected failure at step 3" in "".join(p.read_text() for p in logs.rglob("stdout.log"))


@pytest.mark.slow
def test_inside_torchrun_it_is_one_of_the_workers_and_starts_nothing(tmp_path):
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([sys.executable, *torchrun, "-m", "launch.command", "train", "--nproc-per-node", "2",
                           "--preset", "tiny", "--seq-len", "32", "--steps", "2", "--output-dir", "out"],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    check_ok(proc)
    assert proc.stdout.count("mesh dp=1 x tp=2 on ") == 1, proc.stdout  # two processes, not four


def test_failure_report_is_the_first_rank_its_traceback_and_the_logs(tmp_path):
    recorded = [(1, {"message": "[rank 1] ValueError: bad", "timestamp": 5, "exitcode": 1, "detail": "Traceback"},
                 "/logs/1/error.json"),
                (0, {"message": "[rank 0] the eval of step 2 failed: ...", "timestamp": 6, "exitcode": 1},
                 "/logs/0/error.json")]
    lines = []
    command.faults.PROG = "parallel-lora train"
    try:
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = command._print_failure(recorded, [(2, -15), (3, 1)], tmp_path)
        lines = err.getvalue().splitlines()
    finally:
        command.faults.PROG = None
    assert code == 1
    assert lines == ["",  # a progress bar may have stopped mid-line
                     "parallel-lora train: [rank 1] ValueError: bad",
                     "parallel-lora train: its traceback: /logs/1/error.json",
                     "parallel-lora train: rank 3 exited with code 1 without a message",
                     f"parallel-lora train: logs of every rank: {tmp_path}"]


def test_config_sets_flags_and_the_command_line_wins(tmp_path, no_torchrun):
    config = tmp_path / "run.yaml"
    config.write_text("steps: 7\nseq_len: 32\nbatch-size: 2\nautocast: true\npreset: tiny\nlr: 0.5\n")
    args = cli.parse_args(["--config", str(config), "--steps", "3", "--output-dir", str(tmp_path / "out")])
    assert (args.steps, args.seq_len, args.batch_size, args.autocast, args.preset, args.lr) == (3, 32, 2, True,
                                                                                                  "tiny", 0.5)


def test_written_settings_read_back_as_a_config_give_the_same_run(tmp_path, no_torchrun):
    first = tmp_path / "first"
    args = cli.parse_args(["--preset", "tiny", "--steps", "3", "--max-grad-norm", "inf", "--output-dir", str(first)])
    first.mkdir()
    cli.write_settings(first, args)
    again = cli.parse_args(["--config", str(first / "config.yaml"), "--output-dir", str(tmp_path / "second")])
    assert cli.settings(again) == {**cli.settings(args), "output-dir": str(tmp_path / "second")}


@pytest.mark.parametrize(
    "text, message",
    [
        ("stepz: 3\n", "unknown key 'stepz' (did you mean 'steps'?): keys are the long flag names"),
        ("steps: ten\n", "steps: expected int, got 'ten'"),
        ("preset: huge\n", "preset: expected one of ['base', 'small', 'tiny'], got 'huge'"),
        ("autocast: 1\n", "autocast must be true or false, got 1"),
        ("- steps\n", "expected a mapping of flag names to values, got list"),
    ],
)
def test_a_bad_config_is_refused_in_one_line_naming_the_key(tmp_path, capsys, no_torchrun, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--config", str(config), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and f"--config {config}: {message}" in err, err


def test_the_script_refuses_launch_flags_naming_the_command(tmp_path, capsys, no_torchrun):
    with pytest.raises(SystemExit):
        cli.parse_args(["--nproc-per-node", "2", "--output-dir", str(tmp_path / "out")])
    assert "start processes from the parallel-lora command: run `parallel-lora train" in capsys.readouterr().err
