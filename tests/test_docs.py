"""Every code block in README.md and docs/ runs as written, or says why not; the README stays a short front door
whose links resolve.

A block (a fence with a language) is run in page order, in one fresh folder per page (``launch/`` linked in,
``parallel-lora`` on the path), unless the HTML comment on the line above it marks it:

- ``<!-- fragment: REASON -->``: not meant to run as it stands (placeholders, GPUs, part of a larger program);
- ``<!-- file: NAME -->`` or ``<!-- file: NAME, run: COMMAND -->``: written to NAME before the page runs (and
  COMMAND run at its place);
- ``<!-- ci: REASON -->``: .ci/run runs each of its lines.

A fence without a language holds output or a diagram, never a command.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(fragment|file|ci):\s*(.*?)\s*-->")
COMMANDS = ("python", "torchrun", "pip", "parallel-lora", "import ", "from ", "git ", "bash ")


def test_readme_links_resolve():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert links
    missing = [link for link in links if not (REPO / link).is_file()]
    assert not missing, missing


def test_readme_stays_a_front_door():
    assert len(README.splitlines()) < 120
    limits = README.split("## Known limits", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in limits.splitlines() if line.strip()]) <= 10


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    kind: str | None  # fragment, file, ci, or None: run it
    note: str


def blocks(page: Path) -> list[Block]:
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.fullmatch(above.strip())
            found.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n",
                               marker.group(1) if marker else None, marker.group(2) if marker else ""))
            i = end
        i += 1
    return found


def _words(command: str) -> list[str]:
    """A command's words without what makes .ci/run's spelling differ: ``python3 -m``, ``-q``."""
    words = [w for w in shlex.split(command) if w != "-q"]
    while words[:2] in (["python3", "-m"], ["python", "-m"]):
        words = words[2:]
    return words


def test_every_code_block_runs_or_says_why_not():
    problems = []
    ci = [_words(line) for line in (REPO / ".ci" / "run").read_text().splitlines() if line and line[0].isalpha()]
    for page in PAGES:
        for b in blocks(page):
            where = f"{b.page.relative_to(REPO)}:{b.line}"
            if not b.lang or b.lang == "text":  # a picture or a formula, never run: a command there would go unchecked
                if b.body.lstrip().startswith(COMMANDS):
                    problems.append(f"{where}: a command in a fence without a language")
            elif b.lang not in ("bash", "python"):
                problems.append(f"{where}: unknown language {b.lang!r}")
            elif b.kind == "fragment" and len(b.note) < 10:
                problems.append(f"{where}: a fragment must say why it does not run")
            elif b.kind == "ci":
                missing = [c for c in b.body.splitlines() if c.strip() and _words(c) not in ci]
                problems += [f"{where}: .ci/run does not run {c!r}" for c in missing]
    assert not problems, "\n".join(problems)


def _runnable(page: Path) -> bool:
    return any(b.lang and b.kind in (None, "file") for b in blocks(page))


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_page(page: Path, cwd: Path) -> dict[int, str]:
    """Run ``page``'s blocks as a reader would, in ``cwd``; each run block's output, by line."""
    (cwd / "launch").symlink_to(REPO / "launch")
    bin_dir = cwd / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "parallel-lora"  # the console script, for this checkout whatever is installed
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m launch.command \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    page_blocks = blocks(page)
    for b in page_blocks:
        if b.kind == "file":
            (cwd / b.note.split(",")[0].strip()).write_text(b.body)
    outputs = {}
    for b in page_blocks:
        if b.kind == "file" and ", run:" in b.note:
            outputs[b.line] = _run(["bash", "-c", b.note.split(", run:", 1)[1]], cwd, env).stdout
        elif b.kind is None and b.lang == "bash":
            outputs[b.line] = _run(["bash", "-euo", "pipefail", "-c", b.body], cwd, env).stdout
        elif b.kind is None and b.lang == "python":
            script = cwd / f"block_{b.line}.py"
            script.write_text(b.body)
            outputs[b.line] = _run([sys.executable, str(script)], cwd, env).stdout
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: p.name)
def test_page_runs_as_written(page, tmp_path):
    pytest.importorskip("transformers")
    if page.name == "quickstart.md":
        pytest.importorskip("peft")
    printed = "".join(run_page(page, tmp_path).values())
    if page.name == "README.md":
        losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", printed)]
        assert len(losses) == 5 and losses[-1] < losses[0], printed
        assert {p.name for p in (tmp_path / "out" / "adapter").iterdir()} == {
            "adapter_model.safetensors", "adapter_config.json"}
        assert (tmp_path / "runs" / "mine" / "config.yaml").is_file() and "adapter:" in printed and "base:" in printed
    if page.name == "transformers.md":
        losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", printed)]
        assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
        assert (tmp_path / "runs" / "byo-adapter" / "adapter_config.json").is_file()
    if page.name == "quickstart.md":
        assert "The old fox walked over the " in printed
