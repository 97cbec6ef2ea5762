"""The C++ half of a replayed call (``replay.cpp``): built once per torch build on first use, else None."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("replay.cpp")


@functools.cache
def module():
    """The built extension (``replay(state, x, W, b, A, B, seed) -> y``), or None where it cannot be built."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    where = Path(root) / f"parallel_lora_replay-{digest}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not (where / "parallel_lora_replay.so").exists():
            log.info("parallel_lora: building the C++ replay in %s (once per torch version)", where)
        return load("parallel_lora_replay", [str(SOURCE)], extra_cflags=["-O2"], build_directory=str(where))
    except Exception as e:  # no compiler or headers: calls replay from Python, a few microseconds slower
        log.warning("parallel_lora: the C++ replay could not be built, so calls replay from Python: %s", e)
        return None


def forget() -> None:
    """Drop the programs the ops' C++ kernels keep, where the extension is loaded (``dispatch.clear_sites``)."""
    if module.cache_info().currsize and module() is not None:
        module().forget()
