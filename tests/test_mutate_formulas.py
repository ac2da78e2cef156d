"""The formula mutation check (scripts/mutate_formulas.py) in the slow suite: every planted error caught.

Fast twin: the plants' lines must exist in the code (a plant that no longer applies fails here in
seconds, so the list cannot drift from the code between slow runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.mutate_formulas import PLANTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_plant_applies_to_exactly_one_place_and_changes_it():
    assert len(PLANTS) >= 40 and len({p.name for p in PLANTS}) == len(PLANTS)
    for plant in PLANTS:
        text = (ROOT / plant.path).read_text()
        assert text.count(plant.old) == 1, f"{plant.name}: {plant.old!r} occurs {text.count(plant.old)} times"
        assert plant.new != plant.old


@pytest.mark.slow  # ~5 min: one formula-test run per plant
def test_every_planted_formula_error_is_caught():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate_formulas.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(PLANTS)} of {len(PLANTS)} plants caught" in proc.stdout
