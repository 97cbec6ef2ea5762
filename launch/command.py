"""``parallel-lora``: the main job as an installed command.

    parallel-lora train --nproc-per-node 2                                   # the toy model, tp=2
    parallel-lora train --nproc-per-node 2 --model DIR --data chat.jsonl     # your checkpoint, your data
    parallel-lora train --config run.yaml --steps 3                          # flags from a file; the command line wins
    parallel-lora generate --model DIR --adapter runs/train/adapter --prompt "..."

``--nproc-per-node N`` starts N processes through ``torch.distributed.run``'s Python API (``--nnodes``,
``--rdzv-endpoint``, ``--node-rank`` for several machines); without it the job runs in this process; started by
torchrun, it is one of that launch's workers and starts nothing. Flags are checked here, before any process starts.
A failure ends in a few lines on stderr: a bad input its one message (exit 2); anything else the failing rank's line
and where the logs are (exit 1). See docs/launcher.md.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, NoReturn

from launch import cli, faults

COMMANDS = {"train": "launch.train", "generate": "launch.generate"}
USAGE = """usage: parallel-lora {train,generate} [--nproc-per-node N] [flags]

  train      fine-tune LoRA adapters: the built-in toy model, or --model DIR on --data FILE
  generate   complete --prompt with a checkpoint and a trained --adapter

`parallel-lora train --help` and `parallel-lora generate --help` list the flags."""
USAGE_TRAIN = """examples:
  parallel-lora train --nproc-per-node 2                                  # the toy model, tp=2
  parallel-lora train --nproc-per-node 2 --model DIR --data chat.jsonl    # your checkpoint, your data
  parallel-lora train --config run.yaml --steps 3                         # flags from a file; the command line wins"""


def main(argv: list[str] | None = None) -> NoReturn:
    """The ``parallel-lora`` console command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"parallel-lora: error: unknown command {name!r}: expected train or generate (see parallel-lora --help)",
              file=sys.stderr)
        raise SystemExit(2)
    faults.PROG = f"parallel-lora {name}"
    module = importlib.import_module(COMMANDS[name])
    if cli.under_torchrun():  # a worker of torchrun's launch (or of ours): exactly `torchrun launch/<name>.py`
        faults.run_main(lambda: module.main(rest))
    # Every flag is checked here, once, before anything starts (exit 2 with one line).
    if name == "train":
        args = cli.parse_args(rest, description=module.__doc__.split("\n\n")[0] + "\n\n" + USAGE_TRAIN,
                              launching=True)
    else:
        args = module.parse_args(rest, launching=True)[0]
    log_dir = Path(tempfile.mkdtemp(prefix="parallel-lora-"))
    if args.nproc_per_node is None:
        _in_this_process(module, rest, log_dir)
    code = _start_processes(COMMANDS[name], rest, args, log_dir)
    if code == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    raise SystemExit(code)


def _in_this_process(module: Any, rest: list[str], log_dir: Path) -> NoReturn:
    """Run the job here (a world of one) and report a failure as ``_start_processes`` does."""
    error_file = log_dir / "error.json"
    os.environ.update({"TORCHELASTIC_ERROR_FILE": str(error_file), faults.ERRORS_TO_FILE: "1"})

    def report(code: int) -> int:
        recorded = _recorded(error_file)
        if code in (1, 2) and recorded is not None:
            _print_failure([(0, recorded, str(error_file))], [], log_dir)
        if code == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        return code

    faults.run_main(lambda: module.main(rest), after=report)


def _start_processes(module: str, rest: list[str], args: Any, log_dir: Path) -> int:
    """``torchrun --nproc-per-node N [--nnodes ...] -m module rest``, through ``torch.distributed.run``'s API; the
    exit code, a failure reported in a few lines."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # The agent's own reports (its OMP banner, each worker's exit, ChildFailedError's table) would bury ours.
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    nproc = args.nproc_per_node
    torchrun = ["--nproc-per-node", str(nproc), "--nnodes", str(args.nnodes), "--max-restarts", "0",
                "--log-dir", str(log_dir)]
    if nproc > 1:  # local rank 0 prints to this terminal; the others (which print only their failures) to their logs
        torchrun += ["--redirects", ",".join(f"{r}:3" for r in range(1, nproc))]
    if args.rdzv_endpoint is None:  # one machine: torchrun --standalone's rendezvous, on a free port
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", uuid.uuid4().hex]
    elif args.node_rank is None:
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", "parallel-lora"]
    else:
        torchrun += ["--rdzv-backend", "static", "--rdzv-endpoint", args.rdzv_endpoint, "--node-rank",
                     str(args.node_rank)]
    config, cmd, cmd_args = config_from_args(get_args_parser().parse_args([*torchrun, "--module", module, *rest]))
    os.environ[faults.ERRORS_TO_FILE] = "1"  # the workers write their failures for us to print, once
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        recorded = [(r, _recorded(f.error_file), f.error_file) for r, f in e.failures.items()]
        silent = [(r, f.exitcode) for r, f in e.failures.items() if _recorded(f.error_file) is None]
        if all(code in (130, -signal.SIGINT) for _, code in silent) and len(silent) == len(recorded):
            return 130  # Ctrl-C: rank 0 printed where it stopped
        return _print_failure([x for x in recorded if x[1] is not None], silent, log_dir)
    except (KeyboardInterrupt, SignalException):
        return 130  # rank 0 printed where it stopped
    except Exception as e:  # noqa: BLE001 - the rendezvous failed (a machine never came, a port in use): no rank ran
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"{faults.prog()}: error: the processes could not start: {first}; logs: {log_dir}", file=sys.stderr)
        return 1
    return 0


def _recorded(error_file: str | Path) -> dict | None:
    """The failure ``faults.record`` wrote to ``error_file``, or None (no file, or torchelastic's own)."""
    try:
        data = json.loads(Path(error_file).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "exitcode" in data else None


def _print_failure(recorded: list[tuple[int, dict, str]], silent: list[tuple[int, int]], log_dir: Path) -> int:
    """Print the job's failure in at most four lines: a refusal's message alone (exit 2); else the first failing
    rank's line, where its traceback is, a rank that died without a word, and the logs (exit 1)."""
    prog = faults.prog()
    refused = [data for _, data, _ in recorded if data["exitcode"] == 2]
    if refused:
        print(f"{prog}: error: {refused[0]['message']}", file=sys.stderr)
        return 2
    lines = []
    if recorded:
        _, first, error_file = min(recorded, key=lambda x: (x[1].get("timestamp", 0), x[0]))
        lines.append(f"{prog}: {first['message']}")
        if first.get("detail"):
            lines.append(f"{prog}: its traceback: {error_file}")
    # Ranks that ended without a message (killed, or os._exit); SIGTERM is the agent stopping the others.
    died = [(r, c) for r, c in sorted(silent) if c != -signal.SIGTERM] or ([] if recorded else sorted(silent)[:1])
    for r, code in died[:1]:
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        lines.append(f"{prog}: rank {r} {how} without a message")
    lines.append(f"{prog}: logs of every rank: {log_dir}")
    # From a fresh line: rank 0's progress bar on this terminal may have stopped mid-line.
    print("\n" + "\n".join(lines), file=sys.stderr)
    return 1


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    main()
