"""How ``launch/train.py`` fails: bad flags, a hung rank, Ctrl-C. Real ``torchrun`` subprocesses on CPU/gloo.

Reference: the failure contract in docs/launcher.md. Each failure ends every rank with one line (an argument
error printed once, by rank 0; a stalled collective named with the step and the checkpoint to resume from;
"interrupted at step N" on Ctrl-C) and within a bound, never after torch's 30-minute default timeout. torchrun
adds its own summary of a failed job, which these tests leave alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import cli

REPO = Path(__file__).resolve().parents[1]

TINY = ["--preset", "tiny", "--seq-len", "64", "--batch-size", "4"]


def _cmd(out_dir: Path, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(REPO / "launch" / "train.py"), "--output-dir", str(out_dir), *args]


class _Job:
    """A torchrun job in its own session (like a terminal's foreground job), its output read as it comes."""

    def __init__(self, out_dir: Path, *args: str) -> None:
        self.out_dir, self.lines, self.start = out_dir, [], time.monotonic()
        self.proc = subprocess.Popen(_cmd(out_dir, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for_steps(self, n: int, limit_s: float = 120) -> None:
        metrics = self.out_dir / "metrics.jsonl"
        deadline = time.monotonic() + limit_s
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no step {n} within {limit_s} s\n" + "".join(self.lines)
            time.sleep(0.1)

    def rank_pid(self, rank: int) -> int:
        """The pid of worker ``rank`` of this job (its command line names the job's unique output directory)."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (str(self.out_dir).encode() in cmdline and b"torch.distributed.run" not in cmdline
                    and f"RANK={rank}".encode() in environ):
                return int(pid)
        raise AssertionError(f"no process for rank {rank}")

    def release_when_ended(self, pid: int, limit_s: float) -> None:
        """SIGCONT stopped ``pid`` once torchrun has sent it SIGTERM (pending while it is stopped), or it is gone."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                return
            pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
            if any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending):
                break
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def finish(self, limit_s: float) -> tuple[int, str, float]:
        """(exit code, output, seconds it took); kills the whole session if it runs past ``limit_s``."""
        try:
            code = self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the job did not end within {limit_s} s\n" + "".join(self.lines)) from None
        took = time.monotonic() - self.start
        self._reader.join()
        return code, "".join(self.lines), took


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-grad-norm", "-1"], "--max-grad-norm must be > 0"),
        (["--max-grad-norm", "nan"], "--max-grad-norm must be > 0"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "inf"], "--lr must be a finite number > 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
        (["--rank", "0"], "--rank must be >= 1"),
        (["--alpha", "nan"], "--alpha must be a finite number > 0"),
        (["--dropout", "1.0"], "--dropout must be in"),
        (["--seq-len", "0"], "--seq-len must be >= 1"),
        (["--seq-len", "4096"], "--seq-len must be <= 1024"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--grad-accum", "0"], "--grad-accum must be >= 1"),
        (["--save-every", "0"], "--save-every must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--timeout", "0"], "--timeout must be a finite number > 0"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--dp", "2"], "--dp 2 x --tp 1 must equal the world size 1"),
        (["--tp", "3", "--dp", "1"], "--dp 1 x --tp 3 must equal the world size 1"),
        (["--resume", "--overwrite"], "pass one of them"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_flag_out_of_range_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--output-dir", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err  # one line, no usage block
    assert not (tmp_path / "run").exists()


def test_tp_that_does_not_split_the_heads_is_refused_naming_the_preset(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        cli.parse_args(["--preset", "tiny", "--output-dir", str(tmp_path)])
    assert "--tp 3 does not fit the 'tiny' preset: n_heads=4 must be divisible" in capsys.readouterr().err


@pytest.mark.slow
def test_a_bad_flag_under_torchrun_prints_one_error_and_starts_nothing(tmp_path):
    # --max-grad-norm -1 would train backwards (clipping would scale the gradients by a negative factor).
    out = tmp_path / "run"
    code, output, _ = _Job(out, *TINY, "--steps", "2", "--max-grad-norm", "-1").finish(120)
    assert code != 0
    assert output.count("error: --max-grad-norm must be > 0 (inf: no clipping), got -1.0") == 1, output
    assert "apply_lora" not in output and not out.exists()


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout_with_one_line_naming_the_collective(tmp_path):
    # SIGSTOP rank 1 mid-run: rank 0 waits in a collective for --timeout, then names it and exits; torchrun then
    # sends the stopped rank SIGTERM. The test lets it go then, rather than wait out torchrun's 30 s SIGKILL grace.
    out = tmp_path / "run"
    job = _Job(out, *TINY, "--steps", "1000", "--save-every", "2", "--timeout", "10")
    job.wait_for_steps(3)
    pid = job.rank_pid(1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    job.release_when_ended(pid, 60)
    code, output, _ = job.finish(60)
    took = time.monotonic() - stopped
    assert code != 0
    failed = [line for line in output.splitlines() if "failed:" in line and line.startswith("[rank")]
    assert len(failed) == 1, output
    assert failed[0].startswith("[rank 0] the ") and " of step " in failed[0], failed[0]
    assert "no answer from another rank within --timeout 10 s (it died or hangs)" in failed[0]
    assert f"Resume with --resume (last checkpoint: {out / 'checkpoints'}/step_" in failed[0]
    assert took < 40, f"the job ended {took:.0f} s after the rank stopped"


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_quietly_with_one_line_naming_the_step_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    job = _Job(out, *TINY, "--steps", "1000", "--save-every", "2")
    job.wait_for_steps(3)
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground job
    code, output, took = job.finish(60)
    assert code != 0
    lines = [line for line in output.splitlines() if line.startswith("interrupted at step ")]
    assert len(lines) == 1, output
    assert f"; resume with --resume (last checkpoint: {out / 'checkpoints'}/step_" in lines[0]
    # No rank's traceback (torchrun prefixes its workers' error lines with [rankN]:), only torchrun's own report.
    assert "KeyboardInterrupt" not in output and "[rank0]:" not in output and "[rank1]:" not in output, output
