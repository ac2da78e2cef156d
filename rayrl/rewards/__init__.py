"""Reward functions: ``fn(task, result) -> float``, chosen by name in config (``rollout.reward``)."""

from __future__ import annotations

import importlib
from typing import Callable

from rayrl.agents.base import AgentResult
from rayrl.rewards.gsm8k import agent_reported_reward, gsm8k_reward
from rayrl.rewards.hidden_tests import hidden_tests_reward
from rayrl.rewards.math import numeric_answer_reward
from rayrl.types import Task

RewardFn = Callable[[Task, AgentResult], float]

REWARDS: dict[str, RewardFn] = {
    "calculator": numeric_answer_reward,
    "math": numeric_answer_reward,
    "gsm8k": gsm8k_reward,
    "agent_reported": agent_reported_reward,
    "hidden_tests": hidden_tests_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward, or ``package.module:function``."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise ValueError(f"rollout.reward: unknown reward {name!r}; registered: {sorted(REWARDS)} or module:function")


__all__ = ["RewardFn", "agent_reported_reward", "get_reward_fn", "gsm8k_reward", "hidden_tests_reward",
           "numeric_answer_reward"]
