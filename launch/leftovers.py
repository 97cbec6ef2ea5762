"""What interrupted runs left in ``--output-dir``: the temporaries of writes whose writer is gone, swept at start-up.

Only names the launcher's writers create are candidates (``parallel_lora._files`` beside ``adapter/`` and
``metrics.jsonl``, ``save_checkpoint``'s ``checkpoints/step_<N>.tmp-*``), and only those whose process is gone are
removed (``parallel_lora._files.writer_gone``). docs/launcher.md lists every name ``--output-dir`` can hold.
"""

from __future__ import annotations

from pathlib import Path

from launch.cli import RUN_OUTPUTS
from parallel_lora import remove_stale_checkpoint_temporaries, remove_stale_temporaries


def sweep(out: Path) -> str | None:
    """Remove the stale temporaries of the launcher's outputs in ``out``; the line saying what went, or ``None``."""
    removed = [p for name in RUN_OUTPUTS for p in remove_stale_temporaries(out / name)]
    removed += remove_stale_checkpoint_temporaries(out / "checkpoints")
    if not removed:
        return None
    names = ", ".join(str(p.relative_to(out)) for p in removed)
    return f"removed what interrupted writes left in {out}: {names}"
