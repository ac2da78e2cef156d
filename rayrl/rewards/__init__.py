"""Reward functions: ``reward(task, result) -> float``, chosen by name in config (``rollout.reward``).

A registered name or ``package.module:function``, imported and checked when the config is loaded
(rayrl/preflight.py). The contract (docs/agents.md): ``task`` is the dataset row (``Task``: prompt,
metadata, task_id), ``result`` what the agent ended with (``AgentResult``: ``final_answer``, ``status``
completed / max_turns / error, ``error``, ``info``...). It returns a finite float; 1.0 or more counts as a
success in ``rollout/success_rate``. It is called for every episode the agent finished or failed by its
own doing (``result.status == "error"``: every built-in reward gives 0.0 then), never for an
infrastructure failure. A reward that raises scores 0.0 (``failures/reward_failed``); one that raises
``rayrl.rl.failures.InfrastructureError`` (its grader is down) fails the episode as infrastructure.
"""

from __future__ import annotations

from typing import Callable

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, RolloutConfig
from rayrl.config.rollout import ENVIRONMENT
from rayrl.data.reasoning_gym import reasoning_gym_lenient_reward, reasoning_gym_reward
from rayrl.environments import environment_reward
from rayrl.extensions import check_call, did_you_mean, load_reference
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
    "reasoning_gym": reasoning_gym_reward,
    "reasoning_gym_lenient": reasoning_gym_lenient_reward,
    ENVIRONMENT: environment_reward,  # set by rollout.environment: its rubric scores the episodes
}
BUILT_WITH_CONFIG = ("judge",)  # built by reward_fn_for from their rollout section


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward, or ``package.module:function`` (imported and its signature checked); a
    ConfigError naming ``rollout.reward`` otherwise."""
    if name in REWARDS:
        return REWARDS[name]
    if name in BUILT_WITH_CONFIG:
        raise ConfigError(f"rollout.reward: {name} is built from its config section: use reward_fn_for(rollout)")
    if ":" not in name:
        names = [*REWARDS, *BUILT_WITH_CONFIG]
        raise ConfigError(f"rollout.reward: unknown reward {name!r}{did_you_mean(name, names)}; registered: "
                          f"{', '.join(sorted(names))}, or package.module:function")
    fn = load_reference(name, "rollout.reward")
    check_call(fn, "rollout.reward", name, ("task", "result"), "reward(task, result) -> float")
    return fn


def reward_fn_for(rollout: RolloutConfig) -> RewardFn:
    """``rollout.reward``'s function, built with what it needs from the rollout section (``judge``: the
    judge endpoint of ``rollout.judge``)."""
    if rollout.reward == "judge":
        from rayrl.rewards.judge import judge_reward

        return judge_reward(rollout.judge)
    return get_reward_fn(rollout.reward)


__all__ = ["RewardFn", "agent_reported_reward", "get_reward_fn", "gsm8k_reward", "hidden_tests_reward",
           "numeric_answer_reward", "reward_fn_for"]
