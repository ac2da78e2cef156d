"""No code outside a plug-in table compares a config field that names a plug-in with a literal name
(issue 47 point 1): the rest of the code asks the row's traits. Read from the source's own comparisons, so a
new ``if cfg.rollout.reward == "judge":`` fails here, whatever module it is in."""

from __future__ import annotations

import ast
from pathlib import Path

from rayrl.agents import HARNESSES
from rayrl.data.formats import FORMATS
from rayrl.engines.backends import BACKENDS
from rayrl.orchestration.schedules import SCHEDULES
from rayrl.rewards import REWARDS
from rayrl.rl.advantages import ESTIMATORS
from rayrl.rl.policy_losses import POLICY_LOSSES
from rayrl.sandboxes.factory import PROVIDERS
from rayrl.trainers.backend import TRAINER_BACKENDS

ROOT = Path(__file__).resolve().parent.parent
# config fields whose value is a plug-in's name, and every name the tables hold
PLUGIN_FIELDS = {"reward", "agent", "backend", "schedule", "policy_loss", "advantage_estimator", "format"}
TABLE_NAMES = {name for table in (HARNESSES, FORMATS, BACKENDS, SCHEDULES, REWARDS, ESTIMATORS, POLICY_LOSSES,
                                  PROVIDERS, TRAINER_BACKENDS) for name in table}


def literals(node: ast.expr) -> list[str]:
    """The string constants ``node`` is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in literals(elt)]
    return []


def name_comparisons(path: Path) -> list[str]:
    """``file:line field == 'name'`` for each comparison of a plug-in field with a literal name in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        fields = [op.attr for op in operands if isinstance(op, ast.Attribute) and op.attr in PLUGIN_FIELDS]
        names = [s for op in operands for s in literals(op) if s in TABLE_NAMES]
        if fields and names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {fields[0]} vs {names}")
    return found


def sources() -> list[Path]:
    return [*sorted((ROOT / "rayrl").rglob("*.py")), *sorted((ROOT / "actors").rglob("*.py")), ROOT / "driver.py"]


def test_no_plugin_name_is_compared_outside_its_table() -> None:
    assert [hit for path in sources() for hit in name_comparisons(path)] == []


def test_the_check_sees_a_planted_comparison(tmp_path: Path) -> None:
    planted = ROOT / "rayrl" / "_planted_check.py"
    try:
        planted.write_text("def f(cfg, device):\n    return (cfg.rollout.reward == 'judge' or "
                           "cfg.engine.backend in ('cpu', 'sglang') or device.type == 'cpu')\n")
        assert [hit.split()[1:] for hit in name_comparisons(planted)] == [
            ["reward", "vs", "['judge']"], ["backend", "vs", "['cpu',", "'sglang']"]]
    finally:
        planted.unlink()
