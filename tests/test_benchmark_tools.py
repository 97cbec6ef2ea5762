"""The benchmark scripts' own logic: how rounds interleave the cases (``benchmarks/rounds.py``), how shapes parse
(``benchmarks/report.py``), and how ``benchmarks/compile_check.py`` reads a kernel's SASS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compile_check import wgmma_loops  # noqa: E402
from benchmarks.report import parse_shapes, probe_parser  # noqa: E402
from benchmarks.rounds import back_to_back_ms, ratio_over_rounds, round_order, time_in_rounds  # noqa: E402
from benchmarks.targets import target_rows  # noqa: E402

NAMES = ["cublas", "ours", "peft", "addmm", "slow_fallback"]


def test_every_round_times_every_case_once_and_each_round_is_led_by_another():
    for rnd in range(12):
        order = round_order(NAMES, rnd)
        assert sorted(order) == sorted(NAMES)
        assert order[0] == NAMES[rnd % len(NAMES)]


def test_no_case_follows_the_same_case_in_every_round():
    # A case timed after a slow one reads fast on the H200: over a few rounds every case must have had more
    # than one predecessor, or such a bias would sit on it in every round (a rotation did exactly that).
    rounds = [round_order(NAMES, rnd) for rnd in range(5)]
    for name in NAMES:
        before = {order[order.index(name) - 1] for order in rounds if order.index(name) > 0}
        assert len(before) > 1, (name, before)


def test_the_order_is_the_same_in_every_run():
    # Multi-rank scripts need every rank to issue the same calls in the same order.
    assert [round_order(NAMES, rnd) for rnd in range(4)] == [round_order(list(NAMES), rnd) for rnd in range(4)]


def test_ratio_is_the_median_of_per_round_ratios():
    # Round by round: a base that drifts between rounds does not move the ratio.
    assert ratio_over_rounds([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    assert ratio_over_rounds([1.1, 2.2, 3.3], [1.0, 2.0, 3.0]) == pytest.approx(1.1)


def test_time_in_rounds_times_each_case_once_per_round_in_round_order():
    calls = []
    cases = {name: (lambda n=name: n) for name in NAMES}
    times = time_in_rounds(cases, 3, lambda case: calls.append(case()) or float(len(calls)))
    assert calls == [name for rnd in range(3) for name in round_order(NAMES, rnd)]
    assert all(len(ts) == 3 for ts in times.values())
    assert times[calls[0]][0] == 1.0  # the first call of round 0 is its leader's first time


def test_back_to_back_times_are_per_call_medians_over_batches_after_one_untimed_call():
    clock = {"ms": 0.0, "calls": 0}
    cost = [5.0, 1.0, 1.0, 2.0, 2.0, 9.0, 9.0]  # the untimed first call, then three batches of two

    class Event:  # stands in for torch.cuda.Event: records the fake clock
        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, end):
            return end.at - self.at

    def fn():
        clock["ms"] += cost[clock["calls"]]
        clock["calls"] += 1

    ms = back_to_back_ms(fn, calls=2, batches=3, event=Event, sync=lambda: None)
    assert clock["calls"] == 1 + 2 * 3
    assert ms == 2.0  # batches of 1.0, 2.0 and 9.0 ms per call; the slow first call is not timed


def test_targets_compare_each_round_with_cublas_of_the_same_round_and_flag_each_target():
    def case(name, *ms):
        return {"shape": [8192, 4096, 4096, 16], "case": name, "ms_rounds": list(ms)}

    data = {"rows": [
        case("cublas_y", 1.0, 2.0, 1.0), case("cublas_dx", 1.0, 2.0, 1.0),
        case("new_forward", 1.04, 2.08, 1.5), case("new_backward", 1.1, 2.2, 1.1),
        case("new_forward_drop", 1.04, 2.08, 1.5), case("new_backward_drop", 1.1, 2.2, 1.1),
        *(case(f"old_{c}", 9.0, 9.0, 9.0) for c in ("forward", "backward", "forward_drop", "backward_drop")),
        {"shape": [8, 8, 8, 8], "case": "cublas_y", "ms_rounds": [1.0]},  # no target: left out
    ]}  # fmt: skip
    (row,) = target_rows(data)
    assert row["fwd_ratio"] == pytest.approx(1.04)  # rounds 1.04, 1.04, 1.5: a slow round does not move it
    assert row["fwdbwd_ratio"] == pytest.approx(1.07)  # (1.04 + 1.1) / 2 in two of three rounds
    assert row["dropout_cost"] == pytest.approx(0.0)
    assert row["met"] == {"fwd": True, "fwdbwd": False, "dropout": True}
    assert target_rows(data, tree="old")[0]["fwd_ratio"] == pytest.approx(9.0)


def test_shapes_parse_as_the_scripts_document_them():
    assert parse_shapes("8192,4096,4096,16;2048,4096,14336,64") == [(8192, 4096, 4096, 16), (2048, 4096, 14336, 64)]
    assert parse_shapes("1,2,3,4") == [(1, 2, 3, 4)]


def test_a_probe_defaults_to_the_three_r16_target_shapes_and_keeps_its_own_options():
    parser = probe_parser("a probe", "probe.json")
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args([])
    assert parse_shapes(args.shapes) == [(8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16)]
    assert (args.rounds, args.reps, args.out, args.stages) == (3, 40, "probe.json", 3)
    args = parser.parse_args(["--shapes", "1,2,3,4", "--rounds", "5", "--out", "o.json", "--stages", "4"])
    assert (parse_shapes(args.shapes), args.rounds, args.out, args.stages) == ([(1, 2, 3, 4)], 5, "o.json", 4)


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x2f000], R4 ;
        /*0020*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   LOP3.LUT R2, R2, R3, RZ, 0x3c, !PT ;
        /*0040*/                   IMAD R4, R4, R5, RZ ;
        /*0050*/                   SHF.R.U32.HI R6, RZ, 0x10, R4 ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR10], R24, gsb0 ;
        /*0070*/               @P1 BRA `(.L_x_7) ;
.L_x_8:
        /*0080*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0090*/               @P2 BRA `(.L_x_8) ;
        /*00a0*/                   EXIT ;
"""


def test_wgmma_loops_reports_the_integer_work_between_hgmma_issues():
    # One loop issues two HGMMAs with three integer instructions between them (what delays the tensor cores);
    # the other loop issues none and is not reported.
    assert wgmma_loops(SASS) == [{"instructions": 7, "hgmma": 2, "integer": 3, "max_gap": 3}]


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


def test_gpu_test_runner_times_out_a_stuck_test_and_goes_on_after_it_and_after_a_crash(tmp_path):
    # benchmarks/gpu_tests.py: one stuck test must cost only itself (session 22 lost 16 GPU tests to a timeout
    # around one pytest process), and a crash must not take the tests after it along.
    import io

    from benchmarks.gpu_tests import collect, run_all

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


def test_gpu_test_runner_resumes_an_earlier_run_without_rerunning_its_passed_tests(tmp_path):
    # A full GPU run outlasts one device call (session 23): --resume keeps what passed and runs only the rest.
    import io
    import json

    from benchmarks.gpu_tests import collect, run_all, settled

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
    with pytest.raises(ValueError, match="expected gpu_tests.py's JSON"):
        settled(tmp_path / "other.json")

    rows = run_all(ids, "fake", timeout=60.0, budget=120.0, log=io.StringIO(), cwd=tmp_path, done=done)
    assert rows == [earlier[0], {**rows[1], "outcome": "passed"}, {**rows[2], "outcome": "passed"}]
    assert [row["test"] for row in rows] == ids
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_failed_before", "ran_not_run_before"]
