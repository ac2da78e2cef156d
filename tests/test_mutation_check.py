"""scripts/mutation_check.py: known-wrong code, planted one at a time, each failing the tests named for it.

The default suite holds every plant of every set to the source (its text is there exactly once, it changes
it, and the tests it names exist), so a plant cannot drift from the code between slow runs; the slow tests
run each set itself (each plant's fast tests, in a temporary copy of the checkout).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.mutation_check import SETS, Plant, plant_sets, run_planted

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation_check.py"
MIN_PLANTS = {"gpu": 13, "formulas": 76}  # a table only grows: dropping a plant needs this changed too


def _test_exists(test: str) -> bool:
    path, _, name = test.partition("::")
    return (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text())


def test_every_plant_of_every_set_is_in_the_source_once_and_names_tests_that_exist():
    sets = plant_sets()
    assert set(sets) == set(SETS) == set(MIN_PLANTS)
    every = [p for plants in sets.values() for p in plants]
    assert len({p.name for p in every}) == len(every), "plant names are unique across sets (--only, -k)"
    problems = []
    for set_name, plants in sets.items():
        assert len(plants) >= MIN_PLANTS[set_name], set_name
        for p in plants:
            assert isinstance(p, Plant) and p.why and p.fast and p.old != p.new, p.name
            count = (ROOT / p.path).read_text().count(p.old) if (ROOT / p.path).is_file() else 0
            if count != 1:
                problems.append(f"{set_name}/{p.name}: its old text occurs {count} times in {p.path}")
            problems += [f"{set_name}/{p.name}: no test {t}" for t in (*p.fast, *p.slow) if not _test_exists(t)]
    assert not problems, "\n".join(problems)


def test_a_plant_is_restored_even_when_its_tests_time_out(tmp_path):
    """One copy serves every plant, so a plant must not outlive its run (a hung test included)."""
    (tmp_path / "mod.py").write_text("VALUE = 1\n")
    (tmp_path / "test_mod.py").write_text("import time\n\nimport mod\n\n\ndef test_value():\n"
                                          "    time.sleep(0 if mod.VALUE == 1 else 120)\n")
    hang = Plant("hang", "mod.py", "VALUE = 1", "VALUE = 2", "the test hangs", fast=("test_mod.py",))
    outcome = run_planted(tmp_path, hang, hang.fast, timeout_s=4)
    assert outcome is not None and outcome.result == "timed out", outcome
    assert (tmp_path / "mod.py").read_text() == "VALUE = 1\n" and not list(tmp_path.rglob("__pycache__"))
    passed = run_planted(tmp_path, Plant("same", "mod.py", "VALUE = 1", "VALUE  = 1", "", ("test_mod.py",)),
                         ("test_mod.py",), timeout_s=60)
    assert passed is not None and passed.result == "passed", passed  # an equivalent plant is not a catch
    gone = Plant("gone", "mod.py", "VALUE = 3", "VALUE = 4", "", ("test_mod.py",))
    assert run_planted(tmp_path, gone, gone.fast, timeout_s=60) is None  # not planted, nothing run


@pytest.mark.slow  # ~10 min: every GPU-path plant's fast tests in a copy of the checkout
@pytest.mark.timeout(3600)  # the run's own limit below, not the suite's 600 s
def test_every_gpu_plant_fails_its_tests():
    _run_set("gpu", timeout_s=3600)


@pytest.mark.slow  # ~5 min: one formula-test run per plant
@pytest.mark.timeout(1800)  # the run's own limit below, not the suite's 600 s (a loaded machine took longer)
def test_every_formula_plant_fails_its_tests():
    _run_set("formulas", timeout_s=1800)


def _run_set(name: str, timeout_s: float) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--set", name], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s)
    assert "MISSED" not in out.stdout and "NOT PLANTED" not in out.stdout, out.stdout[-4000:]
    n = len(plant_sets([name])[name])
    assert out.returncode == 0 and f"\n{n} of {n} caught" in out.stdout, (out.stdout[-4000:], out.stderr[-2000:])
