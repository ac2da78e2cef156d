"""GSM8K-style rewards for agents whose result arrives from outside (AgentCore sessions).

``gsm8k_reward``: 1.0 when the agent's final answer equals the task's answer. The expected answer is
``metadata["answer"]``: a number, or a GSM8K solution ending in ``#### <number>``. The agent's answer
is the number after ``####``, else inside ``\\boxed{...}``, else the number after "answer is", else the
last number of the reply (rewards.math.extract_number).

``agent_reported_reward``: the reward the agent computed itself (agentcore-rl-toolkit's contract:
the result's ``rewards``, a number or a list whose last element counts), for agents that score
their own work (unit tests they ran, an environment's score).
"""

from __future__ import annotations

import math
import re

from rayrl.agents.base import AgentResult
from rayrl.rewards.math import extract_number
from rayrl.types import Task

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")


def _to_float(raw: str) -> float | None:
    try:
        return float(raw.replace(",", ""))
    except ValueError:
        return None


def parse_gsm8k_answer(text: str) -> float | None:
    """The number a GSM8K-style reply (or reference solution) commits to, or None."""
    if not text:
        return None
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(text)
        if found:
            return _to_float(found[-1])
    return extract_number(text)


def expected_answer(task: Task) -> float | None:
    raw = task.metadata.get("answer") if isinstance(task.metadata, dict) else None
    if raw is None or isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    return parse_gsm8k_answer(str(raw))


def gsm8k_reward(task: Task, result: AgentResult) -> float:
    """1.0 for a completed episode whose final number equals the reference answer, else 0.0."""
    if result.status != "completed" or result.final_answer is None:
        return 0.0
    expected, got = expected_answer(task), parse_gsm8k_answer(result.final_answer)
    if expected is None or got is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6) else 0.0


def agent_reported_reward(task: Task, result: AgentResult) -> float:
    """The agent's own ``rewards`` (a number, or the last element of a list); 0.0 when absent or failed."""
    if result.status != "completed":
        return 0.0
    rewards = result.info.get("rewards")
    if isinstance(rewards, list):
        rewards = rewards[-1] if rewards else None
    if isinstance(rewards, bool) or not isinstance(rewards, (int, float)) or not math.isfinite(rewards):
        return 0.0
    return float(rewards)
