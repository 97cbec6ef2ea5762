"""How the launcher starts and fails: bounded waits, and one line per failure instead of tracebacks.

- ``init_distributed``: the process group with ``--timeout`` (a world of one when run without torchrun), and a
  ``(dp, tp)`` mesh whose groups get the same timeout (``init_device_mesh`` would give sub-groups torch's
  30-minute default).
- ``at(phase, step)``: what this rank is doing, so that a collective that fails or times out (another rank died,
  hangs, or was stopped) ends this rank with one line naming it and how to resume.
- ``run_main``: runs a launch script's ``main`` (``train.py``, ``generate.py``) and turns Ctrl-C, collective
  failures and argument errors into one message each and an exit code (0 done, 1 failure, 2 bad arguments, 130
  interrupted), leaving through ``os._exit`` (see ``launch/train.py``'s last comment). The resume hint is for a run
  that writes checkpoints.
- Under an elastic agent (torchrun, ``parallel-lora``) a failing rank also writes its message to
  ``$TORCHELASTIC_ERROR_FILE``; started by ``parallel-lora`` (``$PARALLEL_LORA_ERRORS_TO_FILE``) it writes it there
  only, and the command prints it once, for every rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from parallel_lora import is_collective_failure, latest_checkpoint, rank


class _Run:
    """This rank's whereabouts, for the failure message."""

    def __init__(self) -> None:
        self.phase, self.step = "start-up", 0
        self.checkpoints: Path | None = None
        self.timeout_s: float | None = None
        self.interrupted = False


RUN = _Run()
# Set by launch.command for the processes it starts: a failure's message goes to the error file, not to stderr.
ERRORS_TO_FILE = "PARALLEL_LORA_ERRORS_TO_FILE"
PROG: str | None = None  # the name error messages start with (default: the script's file name)


def prog() -> str:
    return PROG or Path(sys.argv[0]).name


def record(code: int, message: str, detail: str | None = None) -> bool:
    """Write this rank's failure to ``$TORCHELASTIC_ERROR_FILE`` (torchelastic's format, plus ``exitcode`` and
    ``detail``: a traceback); returns whether the launcher that started this rank prints it (so this rank must not)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": message, "timestamp": int(time.time()), "exitcode": code, "rank": rank(), "detail": detail}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        return False
    return os.environ.get(ERRORS_TO_FILE) == "1"


def at(phase: str, step: int | None = None) -> None:
    """Record that this rank is in ``phase`` (of ``step``): named if a collective in it fails."""
    RUN.phase = phase if step is None else f"{phase} of step {step}"
    if step is not None:
        RUN.step = step


def local_device() -> torch.device:
    """This process's device: the GPU torchrun's ``LOCAL_RANK`` names (made current), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_distributed(device_type: str, dp: int, tp: int, timeout_s: float, checkpoints: Path) -> DeviceMesh:
    """Start the process group with a ``timeout_s`` on every collective and return the ``(dp, tp)`` mesh.

    Under torchrun it reads the usual environment; without it (``python launch/train.py``) it is a world of one
    on an in-process store, no port needed.
    """
    RUN.timeout_s, RUN.checkpoints = timeout_s, checkpoints
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(timeout=timeout)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    grid = torch.arange(dp * tp).view(dp, tp)
    groups = {}
    for name, lines in (("dp", grid.t()), ("tp", grid)):  # every rank creates every group, in the same order
        for ranks in lines.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                groups[name] = group
    return DeviceMesh.from_group([groups["dp"], groups["tp"]], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))


def refuse(message: str) -> NoReturn:
    """An error in the arguments (every rank finds it): print it once, from rank 0, and exit with code 2."""
    if rank() == 0 and not record(2, message):
        print(f"{prog()}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _resume_hint() -> str | None:
    """The last checkpoint, for a run that writes checkpoints (``None`` for one that does not: nothing to resume)."""
    if RUN.checkpoints is None:
        return None
    latest = latest_checkpoint(RUN.checkpoints)
    return f"last checkpoint: {latest}" if latest else "no checkpoint yet: --resume starts over"


def _cause(exc: BaseException) -> str:
    text = " ".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None).lower()
    if "timed out" in text or "timeout" in text:
        return f"no answer from another rank within --timeout {RUN.timeout_s:g} s (it died or hangs)"
    if "closed" in text or "reset" in text or "broken pipe" in text:
        return "another rank closed its connection (it died)"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _on_sigint(signum, frame) -> None:
    RUN.interrupted = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards the signal again: once is enough
    raise KeyboardInterrupt


def _report(exc: BaseException) -> int:
    """Print one line for ``exc`` (a traceback for a bug), return the exit code."""
    if RUN.interrupted or isinstance(exc, KeyboardInterrupt):
        # Every rank was interrupted; what a rank's peers did meanwhile (closing connections) is no news.
        hint = _resume_hint()
        if rank() == 0:
            print(f"interrupted at step {RUN.step}; resume with --resume ({hint})" if hint else "interrupted",
                  file=sys.stderr)
        return 130
    if is_collective_failure(exc):
        hint = _resume_hint()
        line = f"[rank {rank()}] the {RUN.phase} failed: {_cause(exc)}" + (f". Resume with --resume ({hint})" if hint
                                                                            else "")
        if not record(1, line):
            print(line, file=sys.stderr)
        return 1
    first = (str(exc).strip().splitlines() or [""])[0]
    if not record(1, f"[rank {rank()}] {type(exc).__name__}: {first}", "".join(traceback.format_exception(exc))):
        traceback.print_exception(exc)
    return 1


def outcome(main: Callable[[], None]) -> int:
    """Run ``main()``; its exit code, every failure reported as ``run_main`` does."""
    try:
        main()
        return 0
    except SystemExit as e:  # argparse and refuse() printed their message already
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if code != 0 and rank() != 0:
            # Every rank found the same error; the first to exit makes torchrun stop the others, so let rank 0,
            # the one that prints it, go first.
            time.sleep(2)
        return code
    except BaseException as e:  # noqa: B036 - every way out gets its one line and exit code
        return _report(e)


def run_main(main: Callable[[], None], after: Callable[[int], int] | None = None) -> NoReturn:
    """Run ``main()`` and leave the process with its exit code (``after(code)``'s, if given), one message per
    failure."""
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        code = outcome(main)
    except KeyboardInterrupt:  # Ctrl-C landed while another failure was being reported (the handler is off now)
        code = _report(KeyboardInterrupt())
    if after is not None:
        code = after(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except KeyboardInterrupt:
        pass
    os._exit(code)
