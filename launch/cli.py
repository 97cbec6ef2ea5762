"""The launcher's command line: its flags, their valid ranges, and what may be done to ``--output-dir``.

Everything here is checked before any process group or model exists, from the command line, the environment
torchrun sets (``WORLD_SIZE``, ``RANK``), the files in ``--output-dir`` and, with ``--model``, the checkpoint's
``config.json`` and file headers (``parallel_lora.hf.check_checkpoint``: no weight is read). Every rank parses the
same command line, so usage, ``--help`` and errors print on rank 0 only; a bad flag exits with code 2 on every rank.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import NoReturn

from data import data_file_problem
from model import PRESETS, check_tp, config_for

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
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "adapter", "loss.png")


class RankZeroParser(argparse.ArgumentParser):
    """``argparse`` that prints (help, errors) on rank 0 only, an error as one line."""

    def _print_message(self, message: str, file=None) -> None:
        if rank() == 0:  # $RANK before the process group exists
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = RankZeroParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"size of the built-in toy model (launch/model.py; default {DEFAULT_PRESET})")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer) to "
                        "fine-tune instead of the toy model; needs --data")
    p.add_argument("--data", default=None, metavar="FILE",
                   help='training text for --model: .jsonl lines {"text": ...} or {"prompt": ..., "completion": ...} '
                        "(no loss on the prompt), or .txt (documents separated by blank lines)")
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
    return p


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """The checked arguments, with ``tp`` resolved from the world size. Exits with code 2 on the first problem."""
    p = build_parser(description)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
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
    for key in ("eval_every", "eval_fraction"):
        if getattr(args, key) is not None and args.data is None:
            return f"{_flag(key)} needs --model and --data (the built-in corpus has no held-out slice)"
    if args.model is not None and args.sequence_parallel:
        return "--sequence-parallel is not supported with --model (transformers models run without it here)"
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
        return [f"--dp {args.dp} x --tp {args.tp} must equal the world size {world} (torchrun --nproc-per-node "
                "times --nnodes)"]
    if args.model is not None:
        return [_checkpoint_problem(args)]
    try:
        check_tp(config_for(args.preset), args.tp)
    except ValueError as e:
        return [f"--tp {args.tp} does not fit the '{args.preset}' preset: {e}"]
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


def saved_run(checkpoint: Path) -> dict:
    """The flags a launcher checkpoint was saved with (``RUN_KEYS``, and ``tp``), from its ``meta.json`` (checked
    against its checksum: ``ValueError``)."""
    return checkpoint_meta(checkpoint).get("extra", {})


def _trained(model: str | None, preset: str | None) -> str:
    return f"--model {model}" if model is not None else f"the built-in '{preset}' toy model"
