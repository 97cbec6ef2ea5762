"""What every benchmark script shares about its results: the ``--shapes`` it reads, the facts of the run it
records (``run_meta``), and the JSON it writes, which goes to a temporary file first and is renamed into
place, so a run cut short (a device time limit, a crash) never leaves a torn file where an earlier complete
one was."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"M,K,N,r;M,K,N,r"`` -> ``[(M, K, N, r), ...]``."""
    return [tuple(int(v) for v in shape.split(",")) for shape in text.split(";")]


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
