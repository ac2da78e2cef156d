"""Why an episode failed, and whether the system or the agent is to blame.

Every failed episode carries a ``failure`` kind: a stable label (``failures/<kind>`` in the step metrics)
that does not change with the error message's details. The kinds fall in two classes:

- **infrastructure** (:data:`INFRA_KINDS`): the system let the episode down: its sandbox died, an engine or
  the gateway failed a call (even one the agent then retried: the trajectory it produced was shaped by
  the failure), the episode ran past its deadline, the rollout worker died, the step's deadline came,
  recording or scoring it failed. Its reward says nothing about the policy;
- **agent** (everything else): the harness crashed, or the agent made no LLM call at all.

Either way a failed episode is excluded from its group's advantage statistics and from training
(rayrl/rl/batch.py), counted by kind and logged once. An agent's own *mistakes* are not failures: a bad
tool call, a wrong or missing answer and running out of turns complete the episode, and the reward
function scores them (usually 0), which is exactly what GRPO must learn from. A group that keeps fewer
than ``rollout.min_group_episodes`` successful episodes does not train; it runs again
(rayrl/rl/groups.py ``split_short``).
"""

from __future__ import annotations

from rayrl.types import Episode

ENGINE_ERROR = "engine_error"  # an LLM call failed in the engine or the gateway (5xx)
SANDBOX_FAILED = "sandbox_failed"  # the sandbox could not be leased, or died under the episode
TIMED_OUT = "timed_out"  # the episode ran past rollout.episode_timeout_s
SESSION_FAILED = "session_failed"  # the trajectory manager could not record or finish the session
REWARD_FAILED = "reward_failed"  # the reward function raised
WORKER_DIED = "worker_died"  # the rollout worker died more often than pipeline.max_episode_retries
STEP_DEADLINE = "step_deadline"  # the step's deadline came before the episode finished (sync)
SERVICE_FAILED = "service_failed"  # a hosted agent's service failed the session (AgentCore: invoke, timeout, result)
AGENT_CRASHED = "agent_crashed"  # the harness raised, or reported the agent failed
NO_TURNS = "no_turns"  # the agent ended without any LLM call recorded

INFRA_KINDS = frozenset({ENGINE_ERROR, SANDBOX_FAILED, TIMED_OUT, SESSION_FAILED, REWARD_FAILED, WORKER_DIED,
                         STEP_DEADLINE, SERVICE_FAILED})


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
