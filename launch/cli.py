"""The launcher's command line: its flags, their valid ranges, and what may be done to ``--output-dir``.

Everything here is checked before any process group or model exists, from the command line (and ``--config``'s
YAML file), the environment torchrun sets (``WORLD_SIZE``, ``RANK``), the files in ``--output-dir`` and, with
``--model``, the checkpoint's ``config.json`` and file headers (``parallel_lora.hf.check_checkpoint``: no weight is
read). Every rank parses the same command line, so usage, ``--help`` and errors print on rank 0 only; a bad flag
exits with code 2 on every rank. ``parallel-lora train`` runs the same checks once, before it starts any process.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from launch import faults
from launch.data import data_file_problem, read_documents
from launch.model import PRESETS, check_tp, config_for
from parallel_lora import P_RANGE, checkpoint_meta, latest_checkpoint, rank, valid_p

# Arguments that fix the batches, the model or the schedule: a resumed run that changes one of them
# cannot reproduce the uninterrupted run, so resume warns.
RUN_KEYS = ("preset", "model", "data", "eval_fraction", "seed", "batch_size", "seq_len", "grad_accum", "dp", "steps",
            "lr", "warmup", "rank", "alpha", "autocast")
# Arguments that fix the shapes of the checkpoint's tensors: a resume that changes one of them cannot load it.
SHAPE_KEYS = ("preset", "rank")
DEFAULT_PRESET = "small"
DEFAULT_EVAL_EVERY, DEFAULT_EVAL_FRACTION = 20, 0.05
# Peak learning rates: the toy model trains from random weights; LoRA on a pretrained checkpoint takes ~1e-4-3e-4.
DEFAULT_LR, DEFAULT_MODEL_LR = 1e-2, 2e-4
# What a run writes under --output-dir (a run never removes anything else).
SETTINGS_FILE = "config.yaml"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "adapter", "loss.png", SETTINGS_FILE)
# The flags that say how to start the processes (parallel-lora's), and those that are no setting of the run.
LAUNCH_KEYS = ("nproc_per_node", "nnodes", "rdzv_endpoint", "node_rank")
NOT_SETTINGS = ("config", "resume", "overwrite", "fail_at_step", "fail_rank", *LAUNCH_KEYS)


class RankZeroParser(argparse.ArgumentParser):
    """``argparse`` that prints (help, errors) on rank 0 only, an error as one line; ``--config FILE.yaml`` (where
    the parser has it) sets flags that the command line then overrides."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"prog": faults.prog(), **kwargs})

    def _print_message(self, message: str, file=None) -> None:
        if rank() == 0:  # $RANK before the process group exists
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        faults.refuse(f"{message} (see --help)")

    def parse_args(self, args: list[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(self._config_flags(argv) + argv, namespace)

    def _config_flags(self, argv: list[str]) -> list[str]:
        """The flags ``--config FILE`` in ``argv`` sets, as command-line words (so the command line's own come after
        and win)."""
        if not any(a.startswith("--config") for a in argv) or "--help" in argv or "-h" in argv:
            return []
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv)[0].config
        if path is None:
            return []
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")}
        words = []
        for key, value in read_config(path, self).items():
            dest = key.replace("-", "_")
            action = actions[dest]
            flag = action.option_strings[-1]
            if isinstance(action, argparse._StoreTrueAction):
                if not isinstance(value, bool):
                    self.error(f"--config {path}: {key} must be true or false, got {value!r}")
                words += [flag] if value else []
            elif value is not None:
                problem = _value_problem(action, value)
                if problem:
                    self.error(f"--config {path}: {key}: {problem}")
                words += [flag, str(value)]
        return words


def _value_problem(action: argparse.Action, value: Any) -> str | None:
    want = action.type or str
    if isinstance(value, (bool, list, dict)) or (want is int and not isinstance(value, int)):
        return f"expected {getattr(want, '__name__', 'a value')}, got {value!r}"
    try:
        converted = want(str(value))
    except (TypeError, ValueError):
        return f"expected {getattr(want, '__name__', 'a value')}, got {value!r}"
    if action.choices is not None and converted not in action.choices:
        return f"expected one of {sorted(action.choices)}, got {value!r}"
    return None


def read_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The mapping in the YAML file ``path``; refuses (exit 2) a file that cannot be read or a key that is no flag
    of ``parser`` (keys are the long flag names, with ``-`` or ``_``)."""
    import yaml  # the [train] extra

    path = Path(path)
    if not path.is_file():
        parser.error(f"--config {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})")
    if values is None:
        return {}
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    known = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    for key in values:
        if not isinstance(key, str) or key.replace("-", "_") not in known:
            close = difflib.get_close_matches(str(key).replace("_", "-"), [k.replace("_", "-") for k in known], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            parser.error(f"--config {path}: unknown key {key!r}{hint}: keys are the long flag names --help lists")
    return values


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """The flags with which ``parallel-lora`` starts the processes (``torch.distributed.run``'s names)."""
    g = p.add_argument_group("starting processes (parallel-lora; ignored inside torchrun)")
    g.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N processes on this machine (default: run in this one process)")
    g.add_argument("--nnodes", type=int, default=1, metavar="M",
                   help="machines in the job, each running the same command (default 1; needs --rdzv-endpoint)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the machines meet: one machine's address and a free port, the same on every machine")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this machine's rank (0 .. M-1) for a fixed rendezvous (default: the machines are numbered as "
                        "they arrive)")


def under_torchrun() -> bool:
    """Whether an elastic agent (torchrun, ``parallel-lora``) started this process as one of its workers."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def world_size(args: argparse.Namespace) -> int:
    """The number of processes the job has (torchrun's ``WORLD_SIZE``), or will have once ``parallel-lora`` starts
    them."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if getattr(args, "nproc_per_node", None) is not None and not under_torchrun():
        return args.nproc_per_node * args.nnodes
    return 1


def launch_problem(args: argparse.Namespace, launching: bool) -> str | None:
    """The launch flags' ranges; ``launching``: the ``parallel-lora`` command will start the processes."""
    if under_torchrun() or (args.nproc_per_node is None and args.nnodes == 1 and args.rdzv_endpoint is None
                            and args.node_rank is None):
        return None
    if not launching:
        return ("--nproc-per-node, --nnodes, --rdzv-endpoint and --node-rank start processes from the parallel-lora "
                "command: run `parallel-lora train --nproc-per-node N ...`, or `torchrun --nproc-per-node N "
                "launch/train.py ...`")
    if args.nproc_per_node is None:
        return "--nnodes, --rdzv-endpoint and --node-rank need --nproc-per-node N (the processes per machine)"
    if args.nproc_per_node < 1:
        return f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"
    if args.nnodes < 1:
        return f"--nnodes must be >= 1, got {args.nnodes}"
    if args.nnodes > 1 and args.rdzv_endpoint is None:
        return (f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT: one machine's address and a free port, "
                "the same on every machine")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in [0, --nnodes {args.nnodes}), got {args.node_rank}"
    if args.node_rank is not None and args.rdzv_endpoint is None:
        return "--node-rank needs --rdzv-endpoint HOST:PORT (rank 0's machine and a free port)"
    return None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = RankZeroParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="set flags from a YAML file (keys: the long flag names, e.g. seq-len: 256); flags given on the "
                        f"command line win. Every run writes its settings to <output-dir>/{SETTINGS_FILE}")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"size of the built-in toy model (launch/model.py; default {DEFAULT_PRESET})")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer) to "
                        "fine-tune instead of the toy model; needs --data")
    p.add_argument("--data", default=None, metavar="FILE",
                   help='training text for --model: .jsonl lines {"text": ...}, {"prompt": ..., "completion": ...} '
                        '(no loss on the prompt) or {"messages": [{"role": ..., "content": ...}, ...]} (the '
                        "tokenizer's chat template; loss on assistant turns only), or .txt (documents separated by "
                        "blank lines)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help='a Jinja chat template for --data\'s "messages" lines, for a tokenizer without one (or to '
                        "replace its own)")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"with --data: eval loss on the held-out slice every N steps and at the last step "
                        f"(default {DEFAULT_EVAL_EVERY}; 0: never)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help=f"with --data: the share of the file's windows held out for eval (default "
                        f"{DEFAULT_EVAL_FRACTION}; 0: none)")
    p.add_argument("--autocast", action="store_true",
                   help="run the forward under bf16 autocast (the adapters stay fp32 masters)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world size / dp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard the residual stream along the sequence")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (linear warmup, cosine to 10%%; default {DEFAULT_LR} for the toy model, "
                        f"{DEFAULT_MODEL_LR} with --model)")
    p.add_argument("--warmup", type=int, default=5, help="warmup steps (>= 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay on the adapters")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold (> 0; inf: none)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (characters for the toy model)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per data-parallel rank")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="rerun each block's forward in backward instead of keeping its activations")
    p.add_argument("--output-dir", default="runs/train", help="where metrics, checkpoints and the adapter go")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the last step)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --output-dir (none: start at step 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in --output-dir (its checkpoints, metrics, adapter, plot)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for the other ranks before the job stops (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seeds the base model, the adapters and the batches")
    # Fault injection for tests: rank R dies with os._exit(1) at step K, after backward, before the update.
    p.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)
    add_launch_flags(p)
    return p


def parse_args(argv: list[str] | None = None, description: str = "", launching: bool = False) -> argparse.Namespace:
    """The checked arguments, with ``tp`` resolved from the world size. Exits with code 2 on the first problem.
    ``launching``: ``parallel-lora`` checks them before it starts ``--nproc-per-node`` processes."""
    p = build_parser(description)
    args = p.parse_args(argv)
    problem = launch_problem(args, launching)
    if problem:
        p.error(problem)
    world = world_size(args)
    if args.tp is None:
        args.tp = max(1, world // max(1, args.dp))
    problem = _mode_problem(args)
    if problem:
        p.error(problem)
    if args.data is not None:
        args.eval_every = DEFAULT_EVAL_EVERY if args.eval_every is None else args.eval_every
        args.eval_fraction = DEFAULT_EVAL_FRACTION if args.eval_fraction is None else args.eval_fraction
    if args.model is None:
        args.preset = args.preset or DEFAULT_PRESET
    if args.lr is None:
        args.lr = DEFAULT_LR if args.model is None else DEFAULT_MODEL_LR
    for problem in (*_range_problems(args, world), _output_dir_problem(args)):
        if problem:
            p.error(problem)
    return args


def _mode_problem(args: argparse.Namespace) -> str | None:
    """The toy model (``--preset``) or a checkpoint (``--model`` + ``--data``), and the flags each one takes."""
    if args.data is not None and args.model is None:
        return "--data needs --model DIR (the built-in toy model trains on launch/corpus.txt)"
    if args.model is not None and args.data is None:
        return "--model needs --data FILE (.jsonl or .txt) to train on"
    if args.model is not None and args.preset is not None:
        return "--preset sizes the built-in toy model and --model brings a checkpoint: pass one of them"
    for key in ("eval_every", "eval_fraction", "chat_template"):
        if getattr(args, key) is not None and args.data is None:
            return f"{_flag(key)} needs --model and --data (the built-in corpus has no held-out slice)"
    if args.model is not None and args.sequence_parallel:
        return ("--sequence-parallel is not supported with --model (transformers models run without it here): drop "
                "--sequence-parallel")
    return None


def _range_problems(args: argparse.Namespace, world: int) -> list[str | None]:
    """One message per flag outside its valid range (None where the flag is fine)."""

    def positive_int(key: str) -> str | None:
        value = getattr(args, key)
        return None if value >= 1 else f"{_flag(key)} must be >= 1, got {value}"

    def positive_float(key: str, note: str = "") -> str | None:
        value = getattr(args, key)
        ok = math.isfinite(value) and value > 0
        return None if ok else f"{_flag(key)} must be a finite number > 0{note}, got {value}"

    problems = [positive_int(k) for k in ("steps", "dp", "tp", "rank", "seq_len", "batch_size", "grad_accum",
                                           "save_every")]
    problems += [positive_float("lr"), positive_float("alpha"), positive_float("timeout", " (seconds)")]
    if not (args.max_grad_norm > 0):  # inf is "no clipping"; a negative threshold would flip the gradients
        problems.append(f"--max-grad-norm must be > 0 (inf: no clipping), got {args.max_grad_norm}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        problems.append(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if args.warmup < 0:  # more than --steps is a ramp the run does not finish, still well defined
        problems.append(f"--warmup must be >= 0, got {args.warmup}")
    if not valid_p(args.dropout):
        problems.append(f"--dropout must be in {P_RANGE}, got {args.dropout}")
    if args.seed < 0:
        problems.append(f"--seed must be >= 0, got {args.seed}")
    if args.data is not None:
        problems += _data_problems(args)
    else:
        max_len = PRESETS[args.preset].max_seq_len
        if args.seq_len > max_len:
            problems.append(f"--seq-len must be <= {max_len}, the '{args.preset}' preset's max_seq_len; "
                            f"got {args.seq_len}")
    if any(problems):
        return problems
    if args.dp * args.tp != world:
        return [f"--dp {args.dp} x --tp {args.tp} must equal the world size {world} (--nproc-per-node times "
                f"--nnodes): pass --nproc-per-node {args.dp * args.tp}, or --dp and --tp whose product is {world}"]
    if args.model is not None:
        return [_checkpoint_problem(args)]
    try:
        check_tp(config_for(args.preset), args.tp)
    except ValueError as e:
        return [f"--tp {args.tp} does not fit the '{args.preset}' preset: {e}; pick a --tp (and --nproc-per-node) "
                "that divides it"]
    if args.sequence_parallel and args.seq_len % args.tp != 0:
        return [f"--sequence-parallel needs --seq-len ({args.seq_len}) divisible by --tp ({args.tp})"]
    return []


def _data_problems(args: argparse.Namespace) -> list[str]:
    """The eval flags' ranges and the data file's existence and kind (its lines are read after start-up)."""
    problems = []
    if args.eval_every < 0:
        problems.append(f"--eval-every must be >= 0 (0: never), got {args.eval_every}")
    if not 0.0 <= args.eval_fraction < 1.0:
        problems.append(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    problem = data_file_problem(Path(args.data))
    if problem:
        problems.append(f"--data {problem}")
    else:
        try:  # every line's format, now: tokenizing them waits for the tokenizer, after start-up
            read_documents(args.data)
        except ValueError as e:
            problems.append(f"--data: {e}")
    template = None if args.chat_template is None else Path(args.chat_template)
    if template is not None and not template.is_file():
        problems.append(f"--chat-template {template} {'is not a file' if template.exists() else 'does not exist'} "
                        "(a Jinja template file)")
    return problems


def _checkpoint_problem(args: argparse.Namespace) -> str | None:
    """What ``check_checkpoint`` refuses at this ``--tp`` (path, files, tokenizer, plan, heads), and a ``--seq-len``
    beyond the model's ``max_position_embeddings``. Reads ``config.json`` and the safetensors headers only."""
    from parallel_lora.hf import check_checkpoint, text_config

    try:
        args.checked_model = check_checkpoint(args.model, args.tp)  # from_pretrained reads none of it again
    except ValueError as e:
        return f"--model: {e}"
    max_len = getattr(text_config(args.checked_model.config), "max_position_embeddings", None)
    if isinstance(max_len, int) and args.seq_len > max_len:
        return f"--seq-len must be <= {max_len}, the model's max_position_embeddings; got {args.seq_len}"
    return None


def _output_dir_problem(args: argparse.Namespace) -> str | None:
    """A run never deletes an earlier one unless told to; a resume must fit the checkpoint's tensors."""
    out = Path(args.output_dir)
    if args.resume and args.overwrite:
        return "--resume continues the run in --output-dir and --overwrite replaces it: pass one of them"
    if out.exists() and not out.is_dir():
        return f"--output-dir {out} is a file"
    earlier = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if earlier and not (args.resume or args.overwrite):
        return (f"--output-dir {out} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, "
                "--overwrite to replace it, or choose another --output-dir")
    latest = latest_checkpoint(out / "checkpoints") if args.resume else None
    if latest is None:
        return None
    try:
        saved = saved_run(latest)
    except ValueError as e:  # its meta.json fails its checksum
        return f"--resume: {e}"
    if "preset" in saved and (saved.get("model") is None) != (args.model is None):
        then, now = _trained(saved.get("model"), saved["preset"]), _trained(args.model, args.preset)
        return (f"--resume: {latest} was saved by a run on {then}, and its adapters do not fit a run on {now}. Resume "
                "with the checkpoint's model, or start a new run (--overwrite, or another --output-dir)")
    changed = [k for k in SHAPE_KEYS if k in saved and saved[k] != getattr(args, k)]
    if changed:
        then = " ".join(f"{_flag(k)} {saved[k]}" for k in changed)
        now = " ".join(f"{_flag(k)} {getattr(args, k)}" for k in changed)
        return (f"--resume: {latest} was saved with {then}, and its adapters do not fit a run with {now}. Resume "
                "with the checkpoint's values, or start a new run (--overwrite, or another --output-dir)")
    return None


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's resolved flags, by long flag name: what ``<output-dir>/config.yaml`` holds (``--config`` reads it)."""
    dests = [a.dest for a in build_parser("")._actions if a.option_strings and a.dest != "help"]
    return {d.replace("_", "-"): getattr(args, d) for d in dests if d not in NOT_SETTINGS}


def write_settings(out: Path, args: argparse.Namespace) -> None:
    """Write the run's resolved flags to ``<out>/config.yaml``."""
    import yaml  # the [train] extra

    (out / SETTINGS_FILE).write_text(yaml.safe_dump(settings(args), sort_keys=False), encoding="utf-8")


def resume_warnings(out: Path, args: argparse.Namespace, saved: dict) -> list[str]:
    """One warning per setting that differs from the resumed run's (``<out>/config.yaml``; without it, the flags the
    checkpoint ``saved`` names)."""
    import yaml  # the [train] extra

    path = out / SETTINGS_FILE
    now = settings(args)
    if path.is_file():
        then = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        where = str(path)
    else:  # a run from before config.yaml: its checkpoint's RUN_KEYS
        then = {k.replace("_", "-"): v for k, v in saved.items() if k in RUN_KEYS}
        now = {k: v for k, v in now.items() if k in then}
        where = "the checkpoint"
    lines = []
    for key in [*then, *(k for k in now if k not in then)]:
        if then.get(key) != now.get(key) and key != "output-dir":  # a run copied elsewhere is still the same run
            effect = ": losses will differ from the uninterrupted run" if key.replace("-", "_") in RUN_KEYS else ""
            lines.append(f"warning: resuming with --{key} {now.get(key)}, was {then.get(key)} in {where}{effect}")
    return lines


def saved_run(checkpoint: Path) -> dict:
    """The flags a launcher checkpoint was saved with (``RUN_KEYS``, and ``tp``), from its ``meta.json`` (checked
    against its checksum: ``ValueError``)."""
    return checkpoint_meta(checkpoint).get("extra", {})


def _trained(model: str | None, preset: str | None) -> str:
    return f"--model {model}" if model is not None else f"the built-in '{preset}' toy model"
