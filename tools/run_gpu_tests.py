"""Run the GPU tests within a time budget, so that a slow or stuck test costs only itself (a script, not a test).

    python tools/run_gpu_tests.py --budget 540 --test-timeout 240 --out gpu_tests.json
    python tools/run_gpu_tests.py --first "direct_launch" tests/kernels/test_gpu.py  # one test ahead of the rest
    python tools/run_gpu_tests.py --resume gpu_tests_prev.json --out gpu_tests.json   # the rest of an earlier run
    python tools/run_gpu_tests.py --workers 4 --out gpu_tests.json                   # four pytest processes at once

One ``pytest -m gpu`` process runs all the selected tests in order (compiles and tuning carry over from test to
test). A test that runs past ``--test-timeout`` has its process group killed, is recorded as ``timeout``, and the
tests after it go on in a new process; ``--budget`` stops starting tests, and every test not reached is listed as
``not run``; a test's seconds count from the end of the one before it (a process's first test's from its start:
pytest's own start, imports and collection, may take ``--startup-timeout`` and counts in the wall time only).
pytest's ``faulthandler_timeout`` dumps every thread's stack into the log at ``--test-timeout / 2``,
which says where a stuck test waits. Prints a table, writes ``{"meta": ..., "rows": [{"test", "outcome",
"seconds", "commit"}]}`` after every pytest process, so a run cut short keeps what ran. An outer ``timeout`` around
a single pytest process would lose every test after a stuck one.

``--workers N`` runs every N-th test in each of N such processes at once, on the same GPU: the tests spend most
of their time compiling kernels on the CPU, one core each. The log's lines then start with the worker's number.

A full GPU run can outlast one budget: ``--resume`` takes an earlier run's JSON, whose passed, skipped and xfail
tests keep their rows and are not run again; the JSON written holds every selected test. Every row records the
commit it ran on (``commit_id``: with a hash of uncommitted changes to tracked files, if any), and ``--resume``
refuses a JSON with a row of another commit or other changes. The JSON's ``meta`` gives the call's wall time
(``wall_s``), and the script prints the slowest tests, as ``pytest --durations`` does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
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
_LIVE: set[subprocess.Popen] = set()  # the pytest processes running now, each in a session of its own


def collect(marker: str, paths: list[str], keyword: str, cwd: Path = ROOT) -> list[str]:
    """The node ids pytest selects with ``-m marker`` (and ``-k keyword``) under ``paths``, in run order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, *paths]
    if keyword:
        cmd += ["-k", keyword]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def run_tests(
    ids: list[str], marker: str, timeout: float, deadline: float, log, cwd: Path = ROOT, startup: float = 180.0
) -> tuple[dict, int | None]:
    """Run ``ids`` in one pytest process until they finish, one runs past ``timeout`` (pytest's start-up past
    ``startup``) or ``deadline`` passes. Returns ``{id: (outcome, seconds)}`` for the tests that ended (a killed
    one: ``timeout``) and the process's exit status (None: killed here)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker,
           "-o", f"faulthandler_timeout={max(1, int(timeout // 2))}", *ids]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE.add(proc)
    try:
        return _follow(proc, ids, timeout, deadline, log, startup)
    finally:
        _LIVE.discard(proc)


def _follow(proc: subprocess.Popen, ids: list[str], timeout: float, deadline: float, log, startup: float):
    os.set_blocking(proc.stdout.fileno(), False)
    wanted = set(ids)
    results: dict[str, tuple[str, float]] = {}
    current, started, buffer, starting = None, time.monotonic(), "", True

    def begun(test: str) -> None:
        nonlocal current, started, starting
        if starting:  # the first test's clock starts with it, not with pytest's start-up
            started, starting = time.monotonic(), False
        current = test

    def ended(test: str, outcome: str) -> None:
        nonlocal current, started, starting
        results[test] = (outcome.lower(), time.monotonic() - started)
        current, started, starting = None, time.monotonic(), False

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
                begun(m.group(1))  # a stack dump broke the line
        if (m := _STARTED.match(buffer)) and m.group(1) in wanted and m.group(1) not in (*results, current):
            begun(m.group(1))  # started: its outcome comes at the end of this line
        if not chunk and proc.poll() is not None:
            log.write(buffer)
            return results, proc.returncode
        now = time.monotonic()
        late = now - started > (startup if starting else timeout)
        if late or now > deadline:
            log.write(buffer + "\n")
            _kill(proc)
            if late:
                stuck = current or next((i for i in ids if i not in results), None)
                if stuck is not None:
                    results[stuck] = ("timeout", now - started)
            return results, None
        if not chunk:
            time.sleep(0.2)


def _kill_group(proc: subprocess.Popen) -> bool:
    """SIGKILL ``proc``'s process group; False if it was gone already."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _kill(proc: subprocess.Popen) -> None:
    if not _kill_group(proc):
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # stuck in the driver: leave it, the remaining tests go on without it
        pass


def _stop(signum: int, frame) -> None:
    """SIGTERM (an outer ``timeout``) or Ctrl-C: kill the pytest processes (their own sessions shield them), exit."""
    for proc in list(_LIVE):
        _kill_group(proc)
    os._exit(128 + signum)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=True).stdout.decode(errors="replace")
    except (OSError, subprocess.CalledProcessError):
        return None


def commit_id(cwd: Path = ROOT) -> str | None:
    """The commit checked out at ``cwd``, with ``-dirty-<hash of the diff>`` when tracked files have uncommitted
    changes; None outside a git checkout."""
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        return None
    diff = _git(["diff", "HEAD", "--binary"], cwd) or ""
    dirty = f"-dirty-{hashlib.sha256(diff.encode()).hexdigest()[:12]}" if diff else ""
    return commit.strip() + dirty


def settled(path: str | Path, commit: str | None = None) -> dict[str, dict]:
    """The rows of an earlier run's JSON whose tests need not run again: passed, skipped or xfail. With ``commit``
    (``commit_id``), raises ValueError unless every row ran on that one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("expected run_gpu_tests.py's JSON, {'meta': ..., 'rows': [{'test', 'outcome'}]}")
    rows = data["rows"]
    if commit is not None:
        others = sorted({row.get("commit") or "an unrecorded commit" for row in rows} - {commit})
        if others:
            raise ValueError(f"its tests ran on {', '.join(others)}, this checkout is {commit}: run without --resume")
    return {row["test"]: row for row in rows if row["outcome"] in _SETTLED}


def run_all(
    ids: list[str], marker: str, timeout: float, budget: float, log, cwd: Path = ROOT, on_rows=None,
    done: dict[str, dict] | None = None, commit: str | None = None, startup: float = 180.0,
) -> list[dict]:  # fmt: skip
    """Every id in order but those in ``done`` (rows of an earlier run, kept as they are), a new process after
    each timeout, none started after ``budget`` seconds. ``on_rows`` gets the rows so far after each process
    (tests not reached yet: ``not run``). Each new row records ``commit``."""
    deadline = time.monotonic() + budget
    done = done or {}
    results: dict[str, tuple[str, float]] = {}

    def rows() -> list[dict]:
        out = []
        for i in ids:
            outcome, seconds = results.get(i, ("not run", 0.0))
            out.append(done.get(i) or {"test": i, "outcome": outcome, "seconds": round(seconds, 1), "commit": commit})
        return out

    while time.monotonic() < deadline:
        left = [i for i in ids if i not in results and i not in done]
        if not left:
            break
        got, rc = run_tests(left, marker, timeout, deadline, log, cwd, startup)
        results.update(got)
        missing = [i for i in left if i not in got]
        if rc is not None and rc < 0 and missing:  # the process crashed in a test: the rest go on without it
            results[missing[0]] = ("crashed", 0.0)
        elif rc is not None:  # tests it never reported (a collection error, say): the log says why
            results.update({i: ("unreported", 0.0) for i in missing})
        if on_rows is not None:
            on_rows(rows())
    return rows()


class _Tagged:
    """A log whose lines start with ``tag``; the lines of several writers stay whole."""

    _lock = threading.Lock()

    def __init__(self, log, tag: str) -> None:
        self.log, self.tag, self.at_line_start = log, tag, True

    def write(self, text: str) -> None:
        with self._lock:
            for piece in text.splitlines(keepends=True):
                self.log.write(self.tag + piece if self.at_line_start else piece)
                self.at_line_start = piece.endswith("\n")


def run_parallel(
    ids: list[str], workers: int, marker: str, timeout: float, budget: float, log, cwd: Path = ROOT, on_rows=None,
    done: dict[str, dict] | None = None, commit: str | None = None, startup: float = 180.0,
) -> list[dict]:  # fmt: skip
    """``run_all`` on ``workers`` shards of ``ids`` at once (every ``workers``-th test), each in pytest processes of
    its own; ``on_rows`` gets every row, in ``ids`` order, after each process of any worker."""
    if workers <= 1:
        return run_all(ids, marker, timeout, budget, log, cwd, on_rows, done, commit, startup)
    done = done or {}
    latest: dict[int, list[dict]] = {}
    lock, errors = threading.Lock(), []

    def merged() -> list[dict]:
        by_id = {row["test"]: row for rows in latest.values() for row in rows}
        blank = {"outcome": "not run", "seconds": 0.0, "commit": commit}
        return [by_id.get(i) or done.get(i) or {"test": i, **blank} for i in ids]

    def report(k: int, rows: list[dict]) -> None:
        with lock:
            latest[k] = rows
            if on_rows is not None:
                on_rows(merged())

    def work(k: int) -> None:
        try:
            shard_log = _Tagged(log, f"[{k}] ")
            rows = run_all(ids[k::workers], marker, timeout, budget, shard_log, cwd, lambda rows: report(k, rows),
                           done, commit, startup)  # fmt: skip
            report(k, rows)
        except BaseException as err:  # noqa: B036 - raised again in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return merged()


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, replaced atomically: a run killed mid-write keeps the previous file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def gpu_name() -> str | None:
    """The first GPU's name from ``nvidia-smi`` (this process never touches CUDA itself), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def slowest(rows: list[dict], n: int = 10) -> list[dict]:
    """The ``n`` rows of the most seconds, slowest first (kept rows of a resumed run included)."""
    return sorted((row for row in rows if row["seconds"] > 0), key=lambda row: -row["seconds"])[:n]


def main(argv: list[str] | None = None, cwd: Path = ROOT) -> None:
    """The command line: run the tests of the checkout at ``cwd``, print the table, exit 0 if all settled."""
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or directories (default: tests)")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu)")
    parser.add_argument("--first", default="", help="run the tests whose id contains this first")
    parser.add_argument("--resume", default="", help="an earlier run's JSON at this commit: its passed / "
                        "skipped tests are kept")  # fmt: skip
    parser.add_argument("--test-timeout", type=float, default=240.0, help="seconds one test may take")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds pytest may take to start")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds after which no test starts")
    parser.add_argument("--workers", type=int, default=1, help="pytest processes at once, on the same GPU")
    parser.add_argument("--log", default="gpu_tests.log", help="pytest's output, every process appended")
    parser.add_argument("--out", default="gpu_tests.json")
    args = parser.parse_args(argv)
    commit = commit_id(cwd)
    done = {}
    if args.resume:
        if commit is None:
            sys.exit(f"run_gpu_tests.py: --resume {args.resume}: not a git checkout, so its commit is unknown")
        try:
            done = settled(args.resume, commit)
        except (OSError, ValueError) as err:
            sys.exit(f"run_gpu_tests.py: --resume {args.resume}: {err}")
    ids = collect(args.marker, args.paths, args.keyword, cwd)
    if args.first:
        ids = [i for i in ids if args.first in i] + [i for i in ids if args.first not in i]
    command = " ".join(sys.argv if argv is None else ["run_gpu_tests.py", *argv])
    meta = {"command": command, "commit": commit, "gpu": gpu_name(), "workers": args.workers,
            "resumed": args.resume or None}  # fmt: skip

    def save(rows: list[dict]) -> None:  # after every pytest process: a call cut short keeps what ran
        meta["wall_s"] = round(time.monotonic() - started, 1)
        write_json(args.out, {"meta": meta, "rows": rows})

    with open(args.log, "a") as log:
        rows = run_parallel(ids, args.workers, args.marker, args.test_timeout, args.budget, log, cwd, save, done,
                            commit, args.startup_timeout)  # fmt: skip
    save(rows)
    for row in rows:
        print(f"{row['outcome']:>8} {row['seconds']:7.1f} s  {row['test']}")
    print("slowest tests:")
    for row in slowest(rows):
        print(f"{row['seconds']:7.1f} s  {row['test']}")
    counts = Counter(row["outcome"] for row in rows)
    print(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) + f"; wall time {meta['wall_s']} s")
    sys.exit(0 if set(counts) <= _SETTLED else 1)


if __name__ == "__main__":
    for signum in (signal.SIGTERM, signal.SIGINT):  # the command's, not an in-process caller's
        signal.signal(signum, _stop)
    main()
