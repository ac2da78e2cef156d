"""Numeric-answer reward: 1.0 when the agent's final answer equals the task's answer, else 0.0.

The reward is the real success criterion: a well-formed tool call with a wrong final answer earns
nothing. The answer is the number after "answer is" if present, else the last number in the reply.
"""

from __future__ import annotations

import math
import re

from rayrl.agents.base import AgentResult
from rayrl.types import Task

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def extract_number(text: str) -> float | None:
    """The number the reply commits to, or None."""
    if not text:
        return None
    match = _ANSWER_IS.search(text)
    raw = match.group(1) if match else (_ANY.findall(text) or [None])[-1]
    if raw is None:
        return None
    try:
        return float(raw.replace(",", ""))
    except ValueError:
        return None


def numeric_answer_reward(task: Task, result: AgentResult) -> float:
    """1.0 for a correct final answer (within 1e-6 relative), 0.0 otherwise."""
    if result.status != "completed" or result.final_answer is None:
        return 0.0
    expected = task.metadata.get("answer") if isinstance(task.metadata, dict) else None
    got = extract_number(result.final_answer)
    if expected is None or got is None:
        return 0.0
    return 1.0 if math.isclose(got, float(expected), rel_tol=1e-6, abs_tol=1e-6) else 0.0
