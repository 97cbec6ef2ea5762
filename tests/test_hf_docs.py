"""The runnable example of ``docs/transformers.md``, run as the page says: ``torchrun --nproc-per-node 2`` on a tiny
random Llama checkpoint. It must exit 0, print a falling loss, and leave an adapter PEFT's format holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import _hf
import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- byo_loop.py: tests/test_hf_docs.py runs this block -->"


def _example() -> str:
    page = (REPO / "docs" / "transformers.md").read_text()
    after = page.split(MARKER, 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_docs_example_trains_and_saves_an_adapter(tmp_path):
    script = tmp_path / "byo_loop.py"
    script.write_text(_example())
    model_dir = _hf.write_checkpoint(tmp_path / "tiny-llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(model_dir), str(tmp_path / "adapter")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
