"""The README is a front door: short, and the files it links exist (tests/test_docs.py runs its blocks)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_links_resolve():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert links
    missing = [link for link in links if not (REPO / link).is_file()]
    assert not missing, missing


def test_readme_stays_a_front_door():
    assert len(README.splitlines()) < 120
    limits = README.split("## Known limits", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in limits.splitlines() if line.strip()]) <= 10
