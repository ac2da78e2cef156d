"""The code's docstrings and comments say why, not when: no dated measurement and no branch name in
rayrl/, actors/, jobs/ or driver.py (the figures live in docs/: docs/results/design_figures.md for those
behind a choice in the code). A date in the code goes stale with the next change and names no source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")  # 2026-11-27
BRANCH = re.compile(r"\bbranch(?:es)? [a-z]+\d+[a-z]?\b")  # "branch e26"
CODE = [*(ROOT / "rayrl").rglob("*.py"), *(ROOT / "actors").rglob("*.py"), *(ROOT / "jobs").rglob("*.py"),
        ROOT / "driver.py"]


def stale_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if DATED.search(line) or BRANCH.search(line)]


def test_no_dated_figure_or_branch_name_in_the_code():
    found = {str(p.relative_to(ROOT)): stale_lines(p.read_text()) for p in CODE}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_dated_figure_and_a_branch_name_are_caught():
    assert stale_lines("x = 1  # 1.6x slower (2026-11-27)") == ["x = 1  # 1.6x slower (2026-11-27)"]
    assert stale_lines("docs/results/cpu_engine_goals.md (branch e26)") != []
    assert stale_lines("a trajectory branch forks here; CVE-2025-10164") == []
