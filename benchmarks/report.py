"""What every benchmark script shares about its results: the ``--shapes`` it reads, the facts of the run it
records (``run_meta``), and the JSON it writes, which goes to a temporary file first and is renamed into
place, so a run cut short (a device time limit, a crash) never leaves a torn file where an earlier complete
one was."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"M,K,N,r;M,K,N,r"`` -> ``[(M, K, N, r), ...]``."""
    return [tuple(int(v) for v in shape.split(",")) for shape in text.split(";")]


TARGET_SHAPES = "8192,4096,4096,16;8192,4096,14336,16;8192,14336,4096,16"  # DESIGN section 6's r = 16 shapes


def probe_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """A probe's command line: ``--shapes`` (the target shapes), ``--rounds``, ``--reps`` and ``--out``; the probe
    adds its own options."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=TARGET_SHAPES, help="M,K,N,r;M,K,N,r;...")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (medians)")
    parser.add_argument("--reps", type=int, default=40, help="ms of timed repetitions per measurement")
    parser.add_argument("--out", default=out)
    return parser


def run_meta(**extra) -> dict:
    """The GPU, torch and Triton versions and the command line of this run, plus ``extra``."""
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": "python " + " ".join(sys.argv), **extra}  # fmt: skip


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, replaced atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
