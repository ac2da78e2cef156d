"""Reward functions: ``reward(task, result) -> float``, chosen by name in config (``rollout.reward``).

A built-in name (a row of :data:`REWARDS`, with its traits) or ``package.module:function``, imported and
checked when the config is loaded (rayrl/preflight.py). The contract (docs/agents.md): ``task`` is the
dataset row (``Task``: prompt, metadata, task_id), ``result`` what the agent ended with (``AgentResult``:
``final_answer``, ``status`` completed / max_turns / error, ``error``, ``info``...). It returns a finite
float; 1.0 or more counts as a success in ``rollout/success_rate``. It is called for every episode the
agent finished or failed by its own doing (``result.status == "error"``: every built-in reward gives 0.0
then), never for an infrastructure failure. A reward that raises scores 0.0 (``failures/reward_failed``);
one that raises ``rayrl.rl.failures.InfrastructureError`` (its grader is down) fails the episode as
infrastructure.

Each row names its implementation as ``module:function``, imported when a run builds the reward (as the
harness rows do), so loading this table imports no reward's dependencies (reasoning-gym, an environment's
package) and the packages that implement a row (rayrl/data, rayrl/environments) are not imported by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, RolloutConfig
from rayrl.config.rollout import ENVIRONMENT
from rayrl.extensions import check_call, did_you_mean, load_reference
from rayrl.types import Task

FIELD = "rollout.reward"
RewardFn = Callable[[Task, AgentResult], float]


@dataclass(frozen=True)
class Reward:
    """One built-in reward (``rollout.reward``) and its traits (a row of :data:`REWARDS`).

    ``implementation``: ``module:function`` of ``reward(task, result)``, or with ``built_from_rollout`` of
    ``build(rollout) -> reward`` (the reward reads its own part of the rollout section). ``asks_judge``: it
    grades through ``rollout.judge``, which must then say where the judge is (``base_url``, or ``serve``
    for a judge the run serves). ``from_environment``: the reward ``rollout.environment`` sets (the
    environment's own score); ``rollout.reward`` does not name it itself.
    """

    name: str
    implementation: str
    built_from_rollout: bool = False
    asks_judge: bool = False
    from_environment: bool = False

    def build(self, rollout: RolloutConfig) -> RewardFn:
        """The reward function for a run with ``rollout`` (its implementation imported now)."""
        target = load_reference(self.implementation, FIELD)
        return target(rollout) if self.built_from_rollout else target


REWARDS: dict[str, Reward] = {row.name: row for row in (
    Reward("calculator", "rayrl.rewards.math:numeric_answer_reward"),
    Reward("math", "rayrl.rewards.math:numeric_answer_reward"),
    Reward("gsm8k", "rayrl.rewards.gsm8k:gsm8k_reward"),
    Reward("agent_reported", "rayrl.rewards.gsm8k:agent_reported_reward"),
    Reward("hidden_tests", "rayrl.rewards.hidden_tests:hidden_tests_reward"),
    Reward("reasoning_gym", "rayrl.data.reasoning_gym:reasoning_gym_reward"),
    Reward("reasoning_gym_lenient", "rayrl.data.reasoning_gym:reasoning_gym_lenient_reward"),
    Reward("judge", "rayrl.rewards.judge:judge_reward_for", built_from_rollout=True, asks_judge=True),
    Reward(ENVIRONMENT, "rayrl.environments:environment_reward", from_environment=True),  # set by rollout.environment
)}


def reward_row(name: str) -> Optional[Reward]:
    """The row ``name`` (``rollout.reward``), or None for a ``package.module:function`` of your own."""
    return REWARDS.get(name)


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward that needs no config, or ``package.module:function`` (imported and its signature
    checked); a ConfigError naming ``rollout.reward`` otherwise."""
    row = reward_row(name)
    if row is not None and row.built_from_rollout:
        raise ConfigError(f"{FIELD}: {name} is built from its config section: use reward_fn_for(rollout)")
    if row is not None:
        return load_reference(row.implementation, FIELD)
    if ":" not in name:
        names = [n for n, r in REWARDS.items() if not r.from_environment]
        raise ConfigError(f"{FIELD}: unknown reward {name!r}{did_you_mean(name, names)}; registered: "
                          f"{', '.join(sorted(names))}, or package.module:function")
    fn = load_reference(name, FIELD)
    check_call(fn, FIELD, name, ("task", "result"), "reward(task, result) -> float")
    return fn


def reward_fn_for(rollout: RolloutConfig) -> RewardFn:
    """``rollout.reward``'s function, built with what it needs from the rollout section (a row that is
    ``built_from_rollout``, e.g. ``judge`` with ``rollout.judge``)."""
    row = reward_row(rollout.reward)
    if row is not None and row.built_from_rollout:
        return row.build(rollout)
    return get_reward_fn(rollout.reward)


def check_reward(rollout: RolloutConfig) -> None:
    """What ``rollout.reward``'s row needs of the other fields (rayrl/resolve.py ``check``): a reward that asks
    the judge needs one, and a judge the run serves needs something that asks it."""
    row = reward_row(rollout.reward)
    asks_judge = row is not None and row.asks_judge
    if asks_judge and not (rollout.judge.base_url or rollout.judge.serve):
        raise ConfigError(f"rollout.judge.base_url: rollout.reward: {rollout.reward} needs the judge's "
                          "OpenAI-compatible endpoint (or rollout.judge.serve: a model the run serves as the judge)")
    if rollout.judge.serve and not asks_judge and not rollout.environment:
        raise ConfigError(f"rollout.judge.serve: nothing asks the judge (rollout.reward {rollout.reward!r} does not "
                          "and there is no rollout.environment); unset it")


__all__ = ["REWARDS", "Reward", "RewardFn", "check_reward", "get_reward_fn", "reward_fn_for", "reward_row"]
