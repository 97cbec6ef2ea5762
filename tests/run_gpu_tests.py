"""Run the GPU tests within a time budget, so that a slow or stuck test costs only itself (a script, not a test).

    python tests/run_gpu_tests.py --budget 540 --test-timeout 240 --out gpu_tests.json
    python tests/run_gpu_tests.py --first "direct_launch" tests/test_kernels.py     # one test ahead of the rest
    python tests/run_gpu_tests.py --resume gpu_tests_prev.json --out gpu_tests.json   # the rest of an earlier run

One ``pytest -m gpu`` process runs all the selected tests in order (compiles and tuning carry over from test to
test). A test that runs past ``--test-timeout`` has its process group killed, is recorded as ``timeout``, and the
tests after it go on in a new process; ``--budget`` stops starting tests, and every test not reached is listed as
``not run``; a test's seconds count from the end of the one before it (the first's include pytest's start).
pytest's ``faulthandler_timeout`` dumps every thread's stack into the log at ``--test-timeout / 2``,
which says where a stuck test waits. Prints a table, writes ``{"meta": ..., "rows": [{"test", "outcome",
"seconds"}]}`` after every pytest process, so a run cut short keeps what ran. An outer ``timeout`` around a single
pytest process would lose every test after a stuck one.

A full GPU run can outlast one budget: ``--resume`` takes an earlier run's JSON, whose passed, skipped and xfail
tests keep their rows and are not run again; the JSON written holds every selected test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ``-v`` prints a test's node id when it starts and its outcome when it ends: ``path::name[id] PASSED [ 10%]``
# (the outcome alone on a line when a stack dump came in between).
_OUTCOMES = "PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR"
_ENDED = re.compile(rf"^(\S+::\S+) ({_OUTCOMES})\b")
_BARE = re.compile(rf"^({_OUTCOMES}) +\[")
_STARTED = re.compile(r"^(\S+::\S+) ")
_SETTLED = {"passed", "skipped", "xfail"}


def collect(marker: str, paths: list[str], keyword: str, cwd: Path = ROOT) -> list[str]:
    """The node ids pytest selects with ``-m marker`` (and ``-k keyword``) under ``paths``, in run order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, *paths]
    if keyword:
        cmd += ["-k", keyword]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def run_tests(
    ids: list[str], marker: str, timeout: float, deadline: float, log, cwd: Path = ROOT
) -> tuple[dict, int | None]:
    """Run ``ids`` in one pytest process until they finish, one runs past ``timeout`` or ``deadline`` passes.
    Returns ``{id: (outcome, seconds)}`` for the tests that ended (a killed one: ``timeout``) and the process's
    exit status (None: killed here)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker,
           "-o", f"faulthandler_timeout={max(1, int(timeout // 2))}", *ids]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    os.set_blocking(proc.stdout.fileno(), False)
    wanted = set(ids)
    results: dict[str, tuple[str, float]] = {}
    current, started, buffer = None, time.monotonic(), ""

    def ended(test: str, outcome: str) -> None:
        nonlocal current, started
        results[test] = (outcome.lower(), time.monotonic() - started)
        current, started = None, time.monotonic()

    while True:
        chunk = (proc.stdout.read() or b"").decode(errors="replace")
        *lines, buffer = (buffer + chunk).split("\n")
        for line in lines:
            log.write(line + "\n")
            if (m := _ENDED.match(line)) and m.group(1) in wanted:
                ended(m.group(1), m.group(2))
            elif (m := _BARE.match(line)) and current is not None:
                ended(current, m.group(1))
            elif (m := _STARTED.match(line)) and m.group(1) in wanted and m.group(1) not in results:
                current = m.group(1)  # a stack dump broke the line
        if (m := _STARTED.match(buffer)) and m.group(1) in wanted and m.group(1) not in results:
            current = m.group(1)  # started: its outcome comes at the end of this line
        if not chunk and proc.poll() is not None:
            log.write(buffer)
            return results, proc.returncode
        now = time.monotonic()
        if now - started > timeout or now > deadline:
            log.write(buffer + "\n")
            _kill(proc)
            if now - started > timeout:
                stuck = current or next((i for i in ids if i not in results), None)
                if stuck is not None:
                    results[stuck] = ("timeout", now - started)
            return results, None
        if not chunk:
            time.sleep(0.2)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # stuck in the driver: leave it, the remaining tests go on without it
        pass


def settled(path: str | Path) -> dict[str, dict]:
    """The rows of an earlier run's JSON whose tests need not run again: passed, skipped or xfail."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: expected run_gpu_tests.py's JSON, {{'meta': ..., 'rows': [{{'test', 'outcome'}}]}}")
    rows = data["rows"]
    return {row["test"]: row for row in rows if row["outcome"] in _SETTLED}


def run_all(
    ids: list[str], marker: str, timeout: float, budget: float, log, cwd: Path = ROOT, on_rows=None,
    done: dict[str, dict] | None = None,
) -> list[dict]:  # fmt: skip
    """Every id in order but those in ``done`` (rows of an earlier run, kept as they are), a new process after
    each timeout, none started after ``budget`` seconds. ``on_rows`` gets the rows so far after each process
    (tests not reached yet: ``not run``)."""
    deadline = time.monotonic() + budget
    done = done or {}
    results: dict[str, tuple[str, float]] = {}

    def rows() -> list[dict]:
        out = []
        for i in ids:
            outcome, seconds = results.get(i, ("not run", 0.0))
            out.append(done.get(i) or {"test": i, "outcome": outcome, "seconds": round(seconds, 1)})
        return out

    while time.monotonic() < deadline:
        left = [i for i in ids if i not in results and i not in done]
        if not left:
            break
        got, rc = run_tests(left, marker, timeout, deadline, log, cwd)
        results.update(got)
        missing = [i for i in left if i not in got]
        if rc is not None and rc < 0 and missing:  # the process crashed in a test: the rest go on without it
            results[missing[0]] = ("crashed", 0.0)
        elif rc is not None:  # tests it never reported (a collection error, say): the log says why
            results.update({i: ("unreported", 0.0) for i in missing})
        if on_rows is not None:
            on_rows(rows())
    return rows()


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, replaced atomically: a run killed mid-write keeps the previous file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or directories (default: tests)")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu)")
    parser.add_argument("--first", default="", help="run the tests whose id contains this first")
    parser.add_argument("--resume", default="", help="an earlier run's JSON: its passed / skipped tests are kept")
    parser.add_argument("--test-timeout", type=float, default=240.0, help="seconds one test may take")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds after which no test starts")
    parser.add_argument("--log", default="gpu_tests.log", help="pytest's output, every process appended")
    parser.add_argument("--out", default="gpu_tests.json")
    args = parser.parse_args()
    ids = collect(args.marker, args.paths, args.keyword)
    if args.first:
        ids = [i for i in ids if args.first in i] + [i for i in ids if args.first not in i]
    meta = {"command": " ".join(sys.argv)}

    def save(rows: list[dict]) -> None:  # after every pytest process: a call cut short keeps what ran
        write_json(args.out, {"meta": meta, "rows": rows})

    with open(args.log, "a") as log:
        done = settled(args.resume) if args.resume else {}
        rows = run_all(ids, args.marker, args.test_timeout, args.budget, log, on_rows=save, done=done)
    save(rows)
    for row in rows:
        print(f"{row['outcome']:>8} {row['seconds']:7.1f} s  {row['test']}")
    counts = Counter(row["outcome"] for row in rows)
    print(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    sys.exit(0 if set(counts) <= _SETTLED else 1)


if __name__ == "__main__":
    main()
