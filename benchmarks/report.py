"""Writing a benchmark's results: the JSON goes to a temporary file first and is renamed into place, so a run
cut short (a device time limit, a crash) never leaves a torn file where an earlier complete one was."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, replaced atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
