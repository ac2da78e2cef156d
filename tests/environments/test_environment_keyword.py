"""``rollout.environment`` takes over ``rollout.agent`` and ``rollout.reward`` (rayrl/config/rollout.py
``ENVIRONMENT``): the config's own keyword, which the harness and reward tables key their environment rows by;
each table's row carries the trait (``from_environment``), so no plug-in's name is compared outside its table."""

from __future__ import annotations

import re

import pytest

from rayrl.agents import BUILT_IN, HARNESSES, agent_factory
from rayrl.config import ConfigError, RolloutConfig
from rayrl.config.rollout import ENVIRONMENT
from rayrl.environments import environment_reward
from rayrl.rewards import REWARDS, get_reward_fn


def test_an_environment_takes_the_agent_and_the_reward_left_at_their_defaults() -> None:
    for given in ({}, {"agent": ENVIRONMENT, "reward": ENVIRONMENT}):
        cfg = RolloutConfig(environment="verifiers:sums", **given)
        assert (cfg.agent, cfg.reward) == (ENVIRONMENT, ENVIRONMENT)
        assert HARNESSES[cfg.agent].from_environment and REWARDS[cfg.reward].from_environment
        assert get_reward_fn(cfg.reward) is environment_reward


@pytest.mark.parametrize("given, message", [
    ({"environment": "verifiers:sums", "agent": "chat"},
     "rollout.agent: rollout.environment runs the episodes and scores them; leave rollout.agent unset (or "
     "environment), got 'chat'"),
    ({"environment": "verifiers:sums", "reward": "math"}, "leave rollout.reward unset (or environment), got 'math'"),
    ({"agent": ENVIRONMENT}, "rollout.agent: environment needs rollout.environment (e.g. verifiers:<env>)"),
    ({"reward": ENVIRONMENT}, "rollout.reward: environment needs rollout.environment"),
    ({"environment_args": {"n": 1}}, "rollout.environment_args: set without rollout.environment"),
])
def test_what_an_environment_does_not_combine_with_is_an_error_naming_the_field(given, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RolloutConfig(**given)


def test_the_environment_harness_is_not_offered_as_an_agent_to_name() -> None:
    assert [name for name, row in HARNESSES.items() if row.from_environment] == [ENVIRONMENT]
    assert ENVIRONMENT not in BUILT_IN and len(BUILT_IN) == len(HARNESSES) - 1
    with pytest.raises(ConfigError) as err:
        agent_factory(RolloutConfig(agent="enviroment"))
    assert "unknown agent 'enviroment'" in str(err.value) and "environment" not in str(err.value).split(";")[1]
