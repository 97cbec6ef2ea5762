"""``tools/run_gpu_tests.py``, the script that runs the GPU tests within a time budget: a stuck or crashing test
costs only itself, ``--resume`` runs only what an earlier run at the same commit did not settle, and the JSON
records the commit and the wall time. Checked on fake test files and a scratch git repository."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.run_gpu_tests import collect, commit_id, main, run_all, run_parallel, settled

SCRIPT = Path(__file__).with_name("run_gpu_tests.py")

_FAKE_TESTS = """
import os, signal, time
import pytest

pytestmark = pytest.mark.fake

def test_passes():
    pass

def test_is_stuck():
    time.sleep(60)

def test_fails():
    assert False

def test_crashes():
    os.kill(os.getpid(), signal.SIGKILL)

def test_runs_after_the_crash():
    pass
"""


@pytest.mark.slow
def test_run_gpu_tests_times_out_a_stuck_test_and_goes_on_after_it_and_after_a_crash(tmp_path):
    # One stuck test must cost only itself (a timeout around one pytest process would lose every test after it),
    # and a crash must not take the tests after it along.
    (tmp_path / "test_fake.py").write_text(_FAKE_TESTS)
    (tmp_path / "test_other.py").write_text("def test_unmarked():\n    pass\n")
    ids = collect("fake", ["."], "", cwd=tmp_path)
    assert [i.split("::")[1] for i in ids] == [
        "test_passes", "test_is_stuck", "test_fails", "test_crashes", "test_runs_after_the_crash",
    ]  # fmt: skip
    log, saved = io.StringIO(), []
    rows = run_all(ids, "fake", timeout=4.0, budget=120.0, log=log, cwd=tmp_path, on_rows=saved.append)
    # Rows after each of the three processes (killed at the stuck test, crashed, done): what a cut call keeps.
    assert [[row["outcome"] for row in snapshot][:2] for snapshot in saved] == [["passed", "timeout"]] * 3
    assert saved[0][2]["outcome"] == "not run" and saved[-1] == rows
    outcomes = {row["test"].split("::")[1]: row["outcome"] for row in rows}
    assert outcomes == {
        "test_passes": "passed",
        "test_is_stuck": "timeout",
        "test_fails": "failed",
        "test_crashes": "crashed",
        "test_runs_after_the_crash": "passed",
    }, log.getvalue()
    assert "Timeout" in log.getvalue()  # pytest's faulthandler dumped the stuck test's stack before the kill
    assert [row["outcome"] for row in run_all(ids, "fake", 4.0, 0.0, io.StringIO(), tmp_path)] == ["not run"] * 5


@pytest.mark.slow
def test_run_gpu_tests_resumes_an_earlier_run_without_rerunning_its_passed_tests(tmp_path):
    # A full GPU run can outlast one budget: --resume keeps what passed and runs only the rest.

    (tmp_path / "test_marks.py").write_text(
        "import pathlib\nimport pytest\n\n"
        + "".join(
            f"@pytest.mark.fake\ndef test_{name}():\n    pathlib.Path('ran_{name}').touch()\n\n"
            for name in ("passed_before", "failed_before", "not_run_before")
        )
    )
    ids = collect("fake", ["."], "", cwd=tmp_path)
    earlier = [
        {"test": ids[0], "outcome": "passed", "seconds": 9.9, "commit": "c0"},
        {"test": ids[1], "outcome": "failed", "seconds": 1.0, "commit": "c0"},
        {"test": ids[2], "outcome": "not run", "seconds": 0.0, "commit": "c0"},
        {"test": "test_gone.py::test_no_longer_selected", "outcome": "passed", "seconds": 1.0, "commit": "c0"},
    ]
    (tmp_path / "earlier.json").write_text(json.dumps({"meta": {}, "rows": earlier}))
    done = settled(tmp_path / "earlier.json", "c0")
    assert set(done) == {ids[0], "test_gone.py::test_no_longer_selected"}
    (tmp_path / "other.json").write_text(json.dumps({"tests": earlier}))
    with pytest.raises(ValueError, match="expected run_gpu_tests.py's JSON"):
        settled(tmp_path / "other.json")

    rows = run_all(ids, "fake", timeout=60.0, budget=120.0, log=io.StringIO(), cwd=tmp_path, done=done, commit="c0")
    assert rows == [earlier[0], {**rows[1], "outcome": "passed"}, {**rows[2], "outcome": "passed"}]
    assert {row["commit"] for row in rows} == {"c0"}
    assert [row["test"] for row in rows] == ids
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_failed_before", "ran_not_run_before"]


def _git(cwd, *args) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip


def test_run_gpu_tests_commit_id_names_the_commit_and_uncommitted_changes(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "lib.py").write_text("x = 1\n")
    _git(tmp_path, "add", "lib.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    clean = commit_id(tmp_path)
    assert clean == subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=tmp_path, text=True).strip()
    (tmp_path / "gpu_tests.json").write_text("{}")  # untracked: the runner's own output
    assert commit_id(tmp_path) == clean
    (tmp_path / "lib.py").write_text("x = 2\n")
    edited = commit_id(tmp_path)
    assert edited.startswith(clean + "-dirty-")
    (tmp_path / "lib.py").write_text("x = 3\n")
    assert commit_id(tmp_path) not in (clean, edited), "other uncommitted changes must read as another tree"
    assert commit_id(tmp_path.parent / "no_such_repo_here") is None


def test_run_gpu_tests_resume_refuses_a_run_of_another_commit(tmp_path):
    # The runner's own bug: passes carried over from a run before a change hid the tests that change broke.
    rows = [{"test": "t.py::test_a", "outcome": "passed", "seconds": 1.0, "commit": "c0"},
            {"test": "t.py::test_b", "outcome": "passed", "seconds": 1.0, "commit": "c1"}]  # fmt: skip
    (tmp_path / "mixed.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    with pytest.raises(ValueError, match="its tests ran on c1, this checkout is c0: run without --resume"):
        settled(tmp_path / "mixed.json", "c0")
    unrecorded = {k: v for k, v in rows[0].items() if k != "commit"}  # a row of the runner before commits
    (tmp_path / "old.json").write_text(json.dumps({"meta": {}, "rows": [unrecorded]}))
    with pytest.raises(ValueError, match="ran on an unrecorded commit"):
        settled(tmp_path / "old.json", "c0")
    old = {"meta": {}, "rows": [{**rows[0], "commit": "0" * 40}]}
    (tmp_path / "other.json").write_text(json.dumps(old))
    cmd = [sys.executable, str(SCRIPT), "--resume", str(tmp_path / "other.json"), "--out", str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("run_gpu_tests.py: --resume ") and not (tmp_path / "out.json").exists()


def test_run_gpu_tests_json_records_commit_and_wall_time_and_resumes_at_the_same_commit(tmp_path, capsys):
    (tmp_path / "test_one.py").write_text(
        "import pathlib\nimport pytest\n\n@pytest.mark.fake\ndef test_one():\n    pathlib.Path('ran').touch()\n"
    )
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "test_one.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    out = tmp_path / "out.json"
    argv = ["--marker", "fake", "--out", str(out), "--log", str(tmp_path / "log.txt"), "."]
    with pytest.raises(SystemExit) as exit_status:
        main(argv, cwd=tmp_path)
    assert exit_status.value.code == 0, capsys.readouterr().out
    data, commit = json.loads(out.read_text()), commit_id(tmp_path)
    assert data["meta"]["commit"] == commit and data["meta"]["wall_s"] > 0
    assert [(row["outcome"], row["commit"]) for row in data["rows"]] == [("passed", commit)]
    printed = capsys.readouterr().out
    assert "slowest tests:" in printed and f"wall time {data['meta']['wall_s']} s" in printed
    (tmp_path / "ran").unlink()
    with pytest.raises(SystemExit) as exit_status:
        main([*argv, "--resume", str(out)], cwd=tmp_path)  # the same commit: the passed test is kept
    assert exit_status.value.code == 0 and json.loads(out.read_text())["rows"] == data["rows"]
    assert not (tmp_path / "ran").exists(), "the passed test ran again"


def test_run_gpu_tests_workers_run_their_shares_at_once_and_rows_keep_the_test_order(tmp_path):
    (tmp_path / "test_pids.py").write_text(
        "import os, pathlib\nimport pytest\n\npytestmark = pytest.mark.fake\n\n"
        + "".join(f"def test_{i}():\n    pathlib.Path('pid_{i}').write_text(str(os.getpid()))\n\n" for i in range(4))
        + "def test_fails():\n    assert False\n"
    )
    ids = collect("fake", ["."], "", cwd=tmp_path)
    log, saved = io.StringIO(), []
    rows = run_parallel(ids, 2, "fake", timeout=60.0, budget=120.0, log=log, cwd=tmp_path, on_rows=saved.append,
                        commit="c0")  # fmt: skip
    assert [row["test"] for row in rows] == ids and saved[-1] == rows
    assert [row["outcome"] for row in rows] == ["passed"] * 4 + ["failed"]
    pids = {(tmp_path / f"pid_{i}").read_text() for i in range(4)}
    assert len(pids) == 2, "the tests did not run in two pytest processes"
    lines = [line for line in log.getvalue().splitlines() if "::test_" in line]
    assert {line[:4] for line in lines} == {"[0] ", "[1] "}, log.getvalue()


def test_run_gpu_tests_ends_its_pytest_processes_when_it_is_terminated(tmp_path):
    # An outer ``timeout`` signals the script alone: its pytest processes, in sessions of their own, must not live on.
    (tmp_path / "test_sleeps.py").write_text(
        "import os, pathlib, time\nimport pytest\n\n@pytest.mark.fake\ndef test_sleeps():\n"
        "    pathlib.Path('pid').write_text(str(os.getpid()))\n    time.sleep(120)\n"
    )
    (tmp_path / "tools").mkdir()
    copy = tmp_path / "tools" / SCRIPT.name  # the script runs the tests of the checkout it sits in
    copy.write_text(SCRIPT.read_text())
    script = subprocess.Popen([sys.executable, str(copy), "--marker", "fake", "--out", "out.json", "."],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    pid_file = tmp_path / "pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    script.terminate()
    status = script.wait(timeout=30)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text():
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the pytest process outlived the terminated script")
    assert status == 128 + signal.SIGTERM
