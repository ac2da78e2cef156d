"""Why an episode failed, and whether the system or the agent is to blame.

Every failed episode carries a ``failure`` kind: a stable label (``failures/<kind>`` in the step metrics)
that does not change with the error message's details. The kinds fall in two classes:

- **infrastructure** (:data:`INFRA_KINDS`): the system let the episode down: its sandbox died, an engine or
  the gateway failed a call (even one the agent then retried: the trajectory it produced was shaped by
  the failure), the episode ran past its deadline, the rollout worker died, the step's deadline came,
  recording the session failed, or a service the agent or the reward relies on failed (they say so by
  raising :class:`InfrastructureError`). Its reward says nothing about the policy, so the episode is left
  out of its group's advantage statistics and of training; a group left with fewer than
  ``rollout.min_group_episodes`` usable episodes runs its task again (rayrl/rl/groups.py ``split_short``);
- **the agent's own** (:data:`AGENT_KINDS`: the agent raised or reported an error, made no LLM call, or
  the reward function raised): the episode counts against the task. The reward function scores it
  like any other (its ``result.status`` is ``"error"``; every built-in reward gives 0.0), a reward that
  raised gives 0.0, and it trains with that reward in its group (:func:`is_scored`). Running it again
  would only repeat the bug.

Either way a failed episode is written to ``episodes/``, counted by kind and logged once. An agent's
own *mistakes* are not failures at all: a bad tool call, a wrong or missing answer and running out of
turns complete the episode, and the reward function scores them (usually 0), which is exactly what GRPO
must learn from.
"""

from __future__ import annotations

from rayrl.types import Episode

ENGINE_ERROR = "engine_error"  # an LLM call failed in the engine or the gateway (5xx)
SANDBOX_FAILED = "sandbox_failed"  # the sandbox could not be leased, or died under the episode
TIMED_OUT = "timed_out"  # the episode ran past rollout.episode_timeout_s
SESSION_FAILED = "session_failed"  # the gateway could not record or finish the session
REWARD_FAILED = "reward_failed"  # the reward function raised (the episode scores 0.0)
WORKER_DIED = "worker_died"  # the rollout worker died more often than pipeline.max_episode_retries
STEP_DEADLINE = "step_deadline"  # the step's deadline came before the episode finished (sync)
# a service the episode relies on failed: a hosted agent's (AgentCore: invoke, timeout, result), or any
# InfrastructureError an agent or reward raised
SERVICE_FAILED = "service_failed"
JUDGE_FAILED = "judge_failed"  # the judge model (rollout.reward: judge, an environment's JudgeRubric) gave no verdict
AGENT_CRASHED = "agent_crashed"  # the agent raised, or reported that it failed
NO_TURNS = "no_turns"  # the agent ended without any LLM call recorded

INFRA_KINDS = frozenset({ENGINE_ERROR, SANDBOX_FAILED, TIMED_OUT, SESSION_FAILED, WORKER_DIED, STEP_DEADLINE,
                         SERVICE_FAILED, JUDGE_FAILED})
AGENT_KINDS = frozenset({AGENT_CRASHED, NO_TURNS, REWARD_FAILED})


class InfrastructureError(Exception):
    """Raise this from an agent or a reward function when the system, not the agent, failed: a grader or
    tool service that is down, a quota hit. The episode becomes an infrastructure failure
    (``service_failed``): left out of training, and its group may run again. Any other exception counts
    against the task (see the module docstring)."""


class JudgeError(InfrastructureError):
    """The judge gave no verdict (unreachable, timed out after its retries, or an answer its parse rule
    does not read): ``judge_failed``, an infrastructure failure, never a reward of 0."""


def fail(episode: Episode, kind: str, message: str) -> Episode:
    """Mark ``episode`` failed with ``kind``; the error reads ``"<kind>: <message>"``."""
    episode.status, episode.failure, episode.error = "failed", kind, f"{kind}: {message}"
    return episode


def failure_kind(episode: Episode) -> str:
    """The episode's failure kind, the key of ``failures/<kind>``: its ``failure`` label, or for an error
    without one, the error's text before the first ':' (at most 60 characters); "unknown" without text."""
    if episode.failure:
        return episode.failure
    return (episode.error or "unknown").split(":")[0][:60] or "unknown"


def is_infra(episode: Episode) -> bool:
    """True when the system, not the agent, failed the episode."""
    return not episode.ok and failure_kind(episode) in INFRA_KINDS


def is_scored(episode: Episode) -> bool:
    """True when the episode's reward stands: it completed, or it failed by the agent's or the reward's
    own doing. Such an episode is in its group's advantage statistics and trains (rayrl/rl/batch.py)."""
    return episode.ok or not is_infra(episode)
