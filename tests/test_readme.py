"""The README is a front door: its example runs as written and the files it links exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _using_it_example() -> str:
    section = README.split("## Using it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# PyTorch's gloo can abort a rank during interpreter finalization after everything ran (its worker threads free
# the last collective's tensors without the GIL); it happens with torch's own TP styles too, a few runs in a hundred.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def test_readme_example_trains_and_saves_an_adapter_under_torchrun(tmp_path):
    (tmp_path / "tp_lora.py").write_text(_using_it_example())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "tp_lora.py"]
    for _ in range(3):  # a retry only for the teardown abort, never for a failure of the example itself
        proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if proc.returncode == 0 or GLOO_EXIT_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout
    assert {p.name for p in (tmp_path / "out" / "adapter").iterdir()} == {
        "adapter_model.safetensors", "adapter_config.json"}


def test_readme_links_resolve():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert links
    missing = [link for link in links if not (REPO / link).is_file()]
    assert not missing, missing


def test_readme_stays_a_front_door():
    assert len(README.splitlines()) < 100
    limits = README.split("## Known limits", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in limits.splitlines() if line.strip()]) <= 10
