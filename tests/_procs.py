"""What the tests that start processes (torchrun, the installed command) share."""

from __future__ import annotations

import subprocess


def check_ok(proc: subprocess.CompletedProcess) -> None:
    """Assert that ``proc`` exited 0, showing the ends of its output otherwise."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
