"""Environments written for other frameworks, run unchanged: ``rollout.environment: <kind>:<target>``.

One table of kinds (:data:`ENVIRONMENT_KINDS`), each a record of how to load an environment, turn its
data into rayrl tasks and run one episode of it against the gateway. Today: ``verifiers`` (Prime
Intellect's classic Environment API; rayrl/environments/verifiers_env.py says why that one). With an
environment set, the environment is the agent (``rollout.agent: environment``), its own score is the
reward (``rollout.reward: environment``, each of its reward functions kept as ``reward/<name>``) and its
dataset gives the tasks (docs/environments.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rayrl.config import ConfigError

FIELD = "rollout.environment"


@dataclass(frozen=True)
class EnvironmentKind:
    """How rayrl runs one kind of environment."""

    name: str
    package: str  # the PyPI package it needs
    extra: str  # the rayrl extra that installs it
    module: str  # the rayrl module with load(target, args), tasks(env, ...), harness(ref, args)


ENVIRONMENT_KINDS: dict[str, EnvironmentKind] = {
    "verifiers": EnvironmentKind("verifiers", "verifiers", "verifiers", "rayrl.environments.verifiers_env"),
}


def parse_ref(ref: str) -> tuple[EnvironmentKind, str]:
    """``kind:target`` split and checked; a ConfigError naming the field otherwise."""
    from rayrl.extensions import did_you_mean

    kind, sep, target = ref.partition(":")
    if not sep or not target:
        raise ConfigError(f"{FIELD}: expected <kind>:<environment>, e.g. verifiers:reverse-text or "
                          f"verifiers:my_pkg.my_env:load_environment; got {ref!r}")
    if kind not in ENVIRONMENT_KINDS:
        raise ConfigError(f"{FIELD}: unknown environment kind {kind!r}{did_you_mean(kind, list(ENVIRONMENT_KINDS))}; "
                          f"kinds: {', '.join(ENVIRONMENT_KINDS)}")
    return ENVIRONMENT_KINDS[kind], target


def kind_module(ref: str) -> tuple[Any, str]:
    """The kind's module (imported) and the target."""
    import importlib

    kind, target = parse_ref(ref)
    return importlib.import_module(kind.module), target


def harness_factory(ref: str, args: dict[str, Any], judge: Any = None) -> Callable[[], Any]:
    """What constructs the harness that runs ``ref``'s episodes (one per rollout worker); ``judge``:
    ``rollout.judge``, which the environment's judge rubrics then ask."""
    module, target = kind_module(ref)
    return lambda: module.EnvironmentHarness(target, dict(args), judge)


def environment_harness(rollout: Any) -> Callable[[], Any]:
    """``rollout.agent: environment`` (its row in rayrl/agents/): what constructs the harness of
    ``rollout.environment``, with ``rollout.environment_args`` and ``rollout.judge``."""
    parse_ref(rollout.environment or "")
    return harness_factory(rollout.environment or "", dict(rollout.environment_args), rollout.judge)


def environment_reward(task: Any, result: Any) -> float:
    """``rollout.reward: environment``: the score the environment gave the episode, which its harness put in
    ``result.info["environment_reward"]``. A reward function of the environment that raised (listed in
    ``result.info["reward_errors"]``) fails the scoring with its cause instead of scoring 0; one whose judge
    failed (``judge_errors``) makes the episode an infrastructure failure (``judge_failed``)."""
    judge_errors = result.info.get("judge_errors")
    if judge_errors:  # its judge gave no verdict: the infrastructure failed, not the episode
        from rayrl.rl.failures import JudgeError

        raise JudgeError("; ".join(judge_errors))
    errors = result.info.get("reward_errors")
    if errors:
        raise RuntimeError("; ".join(errors))
    score = result.info.get("environment_reward")
    if score is None:
        if result.status == "error":
            return 0.0
        raise ValueError(f"the environment gave task {task.task_id} no score")
    return float(score)
