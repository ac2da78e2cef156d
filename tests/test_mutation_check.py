"""scripts/mutation_check.py: known-wrong GPU-path calls, planted one at a time, each failing the tests.

The default suite holds the plants to the source (each one's text is there exactly once, and the tests it
names exist); the slow test runs the check itself (each plant's fast tests, in a temporary copy).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_plant_is_in_the_source_once_and_names_tests_that_exist():
    check = _module()
    assert len({p.name for p in check.PLANTS}) == len(check.PLANTS) >= 8
    for p in check.PLANTS:
        assert (ROOT / p.path).read_text().count(p.old) == 1, p.name
        assert p.old != p.new and p.fast, p.name
        for test in (*p.fast, *p.slow):
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), test
            assert not name or f"def {name}(" in (ROOT / path).read_text(), test


@pytest.mark.slow  # ~10 min: every plant's fast tests in a copy of the checkout
def test_every_plant_fails_its_tests():
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert "MISSED" not in out.stdout and "NOT PLANTED" not in out.stdout, out.stdout[-4000:]
    assert out.returncode == 0 and " caught" in out.stdout, (out.stdout[-4000:], out.stderr[-2000:])
