"""examples/swe end to end with scripted policies: the plumbing a coding agent's RL needs, all real.

The real task rows (examples/swe/data/tasks.jsonl), the real python tool-use agent with its file tools,
the real gateway (recording every turn), a scripted engine standing in for a model that already knows
the fix (or a wrong one), real local sandboxes, and the real hidden-tests reward, which runs the hidden
tests on the agent's files in a fresh sandbox. A policy that fixes the bug scores 1; one that makes only
the visible test pass, or tries to plant its own tests or a fake unittest, scores 0.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rayrl.agents.episode import EpisodeRunner
from rayrl.agents.python_agent import PythonToolAgent
from rayrl.config import RolloutConfig
from rayrl.rewards.hidden_tests import hidden_tests_reward
from rayrl.types import Task
from tests.gateway.episode_kit import InProcessSessions, LocalSandboxes

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ["list_dir", "read_file", "write_file", "search"]


def _task(name: str) -> Task:
    rows = [json.loads(line) for line in (ROOT / "examples/swe/data/tasks.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["metadata"]["task"] == name)
    return Task(row["prompt"], row["metadata"], task_id=row["id"])


def _call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _policy(*steps: str):
    """A scripted model: the i-th LLM call of the episode gets steps[i]; the prompts it saw are kept."""
    seen: list[str] = []

    def script(prompt: str) -> str:
        seen.append(prompt)
        return steps[min(len(seen), len(steps)) - 1]

    return script, seen


def _run(scripted, task: Task, *steps: str):
    script, seen = _policy(*steps)
    stack = scripted(script)
    cfg = RolloutConfig(tools=TOOLS, few_shot_examples=0, max_turns=len(steps) + 1, episode_timeout_s=120,
                        max_tokens=512)
    runner = EpisodeRunner(PythonToolAgent(tools=TOOLS), hidden_tests_reward, InProcessSessions(stack),
                           LocalSandboxes(), cfg, "tiny")
    return runner.run(task, "swe", 0), seen


FIXED_MEAN = (ROOT / "examples/swe/tasks/mean/repo/stats/core.py").read_text().replace(
    "sum(values) / len(values) - 1", "sum(values) / len(values)")


def test_a_policy_that_fixes_the_bug_scores_one(scripted):
    episode, seen = _run(scripted, _task("mean"),
                         _call("list_dir", path="stats"),
                         _call("read_file", path="stats/core.py"),
                         _call("write_file", path="stats/core.py", content=FIXED_MEAN),
                         "Removed the stray - 1 from mean().")
    assert episode.ok and episode.reward == 1.0, episode.info
    assert episode.info["tool_calls"] == 3 and episode.info["tool_errors"] == 0
    assert "sum(values) / len(values) - 1" in seen[2]  # the model read the buggy file from its sandbox
    assert episode.samples and episode.generated_tokens > 0  # every turn recorded for training


def test_only_the_visible_test_passing_scores_zero(scripted):
    special_cased = FIXED_MEAN.replace("return sum(values) / len(values)",
                                       "return 2.0 if values == [1, 2, 3] else sum(values) / len(values) - 1")
    episode, _ = _run(scripted, _task("mean"), _call("write_file", path="stats/core.py", content=special_cased),
                      "Done.")
    assert episode.ok and episode.reward == 0.0  # a wrong fix is the agent's mistake: scored, not failed


def test_the_hidden_tests_are_not_in_the_sandbox_and_cannot_be_replaced(scripted):
    fake_unittest = "import sys\nsys.exit(0)\n"
    always_pass = "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    episode, seen = _run(scripted, _task("leap"),
                         _call("search", text="leap", path="."),
                         _call("write_file", path="unittest.py", content=fake_unittest),
                         _call("write_file", path="hidden/test_hidden.py", content=always_pass),
                         _call("write_file", path="sitecustomize.py", content=fake_unittest),
                         "Done.")
    assert episode.ok and episode.reward == 0.0
    listing = seen[1]  # the search's output: the repository's files only, no hidden tests, no git history
    assert "calendar_tools/years.py" in listing and not re.search(r"hidden|\.git", listing.split("search")[-1])


def _starter_rows() -> list[dict]:
    return [json.loads(line) for line in (ROOT / "examples/swe/data/starter.jsonl").read_text().splitlines()]


def test_every_starter_task_fails_as_shipped_and_passes_with_the_fix_its_issue_names():
    from rayrl.rewards.hidden_tests import DEFAULT_TEST_COMMAND, run_hidden_tests

    rows = _starter_rows()
    assert len(rows) >= 8
    for row in rows:
        meta = row["metadata"]
        (path, text), = meta["files"].items()
        wrong, right = re.fullmatch(r".* returns (.+)\. Change it to return (.+)\.", meta["question"]).groups()
        assert text.rstrip("\n").endswith(f"return {wrong}")
        fixed = text.replace(f"return {wrong}", f"return {right}")
        assert not run_hidden_tests(meta["files"], meta["hidden_tests"], DEFAULT_TEST_COMMAND)[0], row["id"]
        assert run_hidden_tests({path: fixed}, meta["hidden_tests"], DEFAULT_TEST_COMMAND)[0], row["id"]


def test_the_cpu_config_shows_the_write_file_demos_and_a_starter_fix_scores_one(scripted):
    """examples/swe/config.yaml as shipped: the model's first prompt holds write_file's read-then-write
    demos (demos come in rollout.tools order), and a policy doing what they show fixes a starter task."""
    from rayrl.agents import agent_factory
    from rayrl.config import load_config

    cfg = load_config(ROOT / "examples/swe/config.yaml", [])
    assert cfg.data.train_path.endswith("starter.jsonl")
    row = next(r for r in _starter_rows() if r["metadata"]["task"] == "area")
    task = Task(row["prompt"], row["metadata"], task_id=row["id"])
    script, seen = _policy(_call("read_file", path="area.py"),
                           _call("write_file", path="area.py", content="def area(w, h): return w * h"),
                           "Fixed: area(w, h) now returns w * h.")
    sessions = InProcessSessions(scripted(script, cfg.gateway))
    runner = EpisodeRunner(agent_factory(cfg.rollout)(), hidden_tests_reward, sessions, LocalSandboxes(), cfg.rollout,
                           "tiny")
    episode = runner.run(task, "swe", 0)
    assert episode.ok and episode.reward == 1.0, episode.info
    first = seen[0]
    assert first.count('<tool_call>{"name": "write_file"') == 2 and '"name": "list_dir"' not in first
    assert first.rstrip().endswith("assistant") and row["prompt"] in first
    assert "def area(w, h): return w + h" in seen[1]  # the read came from the episode's sandbox
