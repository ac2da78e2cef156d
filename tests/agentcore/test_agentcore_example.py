"""examples/agentcore as shipped: its problems and what its math agent sends the model.

The example must train SmolLM2-135M on a CPU (docs/guards.md, "On the shipped examples"): one-step
problems with small numbers, and three worked examples the agent sends as earlier chat turns. These
tests pin both, so a change that quietly makes the problems unsolvable again, or drops the examples,
fails here instead of in a 10-step run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time

import pytest
from _agentcore_kit import ROOT

from rayrl.agents.agentcore.executor import RolloutContext
from rayrl.agents.base import AgentResult
from rayrl.rewards.gsm8k import gsm8k_reward
from rayrl.types import Task

EXAMPLE = ROOT / "examples" / "agentcore"
ONE_STEP = [  # (pattern, answer from its numbers)
    (r"\w+ has (\d+) \w+\. \w+ gets (\d+) more \w+\. How many \w+ does \w+ have now\?", lambda a, b: a + b),
    (r"\w+ has (\d+) \w+ and gives away (\d+) of them\. How many \w+ does \w+ have left\?", lambda a, b: a - b),
    (r"\w+ has (\d+) \w+ with (\d+) \w+ in each\. How many \w+ does \w+ have\?", lambda a, b: a * b),
]


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "data" / name).read_text().splitlines()]


def test_every_problem_is_one_step_with_small_numbers_and_the_right_answer():
    rows = _rows("train.jsonl") + _rows("val.jsonl")
    assert len(rows) == 240 and len({r["prompt"] for r in rows}) == 240
    kinds = set()
    for row in rows:
        meta = row["metadata"]
        assert meta["prompt"] == row["prompt"]
        matched = [(i, m) for i, (pattern, _) in enumerate(ONE_STEP) if (m := re.fullmatch(pattern, meta["prompt"]))]
        assert len(matched) == 1, meta["prompt"]
        kind, match = matched[0]
        a, b = (int(x) for x in match.groups())
        assert max(a, b) <= 15 and int(meta["answer"]) == ONE_STEP[kind][1](a, b) > 0, meta
        kinds.add(kind)
    assert kinds == {0, 1, 2}


def _math_agent():
    pytest.importorskip("bedrock_agentcore")
    spec = importlib.util.spec_from_file_location("example_math_agent", EXAMPLE / "math_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_sends_its_worked_examples_as_earlier_turns(scripted):
    module = _math_agent()
    row = _rows("train.jsonl")[0]
    seen: list[str] = []

    def script(prompt: str) -> str:
        seen.append(prompt)
        return f"Worked out.\n#### {row['metadata']['answer']}"

    stack = scripted(script)
    info = stack.open(task_id=row["id"])
    rollout = RolloutContext(base_url=info.base_url, api_key=info.token, model="tiny", exp_id="t",
                             session_id=info.session_id, sampling={"max_tokens": 32}, max_turns=2,
                             deadline=time.monotonic() + 60)
    out = module.math_agent.fn(row["metadata"], rollout)
    assert out["turns"] == 1 and len(seen) == 1  # '####' on the first reply: no follow-up
    prompt = seen[0]
    positions = []
    for question, worked in module.EXAMPLES:
        user = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{worked}<|im_end|>"
        assert user in prompt
        positions.append(prompt.index(user))
    assert len(positions) == 3 and positions == sorted(positions)
    assert positions[-1] < prompt.index(f"<|im_start|>user\n{row['prompt']}<|im_end|>")
    task = Task(row["prompt"], row["metadata"], task_id=row["id"])
    assert gsm8k_reward(task, AgentResult(status="completed", final_answer=out["final_answer"])) == 1.0
