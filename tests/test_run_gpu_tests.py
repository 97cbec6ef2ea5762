"""``tests/run_gpu_tests.py``, the script that runs the GPU tests within a time budget: a stuck or crashing test
costs only itself, and ``--resume`` runs only what an earlier run did not settle. Checked on fake test files."""

from __future__ import annotations

import io
import json

import pytest
from run_gpu_tests import collect, run_all, settled

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
        {"test": ids[0], "outcome": "passed", "seconds": 9.9},
        {"test": ids[1], "outcome": "failed", "seconds": 1.0},
        {"test": ids[2], "outcome": "not run", "seconds": 0.0},
        {"test": "test_gone.py::test_no_longer_selected", "outcome": "passed", "seconds": 1.0},
    ]
    (tmp_path / "earlier.json").write_text(json.dumps({"meta": {}, "rows": earlier}))
    done = settled(tmp_path / "earlier.json")
    assert set(done) == {ids[0], "test_gone.py::test_no_longer_selected"}
    (tmp_path / "other.json").write_text(json.dumps({"tests": earlier}))
    with pytest.raises(ValueError, match="expected run_gpu_tests.py's JSON"):
        settled(tmp_path / "other.json")

    rows = run_all(ids, "fake", timeout=60.0, budget=120.0, log=io.StringIO(), cwd=tmp_path, done=done)
    assert rows == [earlier[0], {**rows[1], "outcome": "passed"}, {**rows[2], "outcome": "passed"}]
    assert [row["test"] for row in rows] == ids
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_failed_before", "ran_not_run_before"]
