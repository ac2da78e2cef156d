"""The ``agentcore`` harness: one episode = one AgentCore session, through a shared launcher.

The EpisodeRunner opens the gateway session as for any harness; this harness hands the agent its
payload (the task's ``metadata``, a shallow copy, plus ``rollout_config``) through the launcher and
turns the S3 result into an AgentResult for the reward. The gateway session id doubles as the
runtimeSessionId, so a failed episode's id finds both our gateway log and the runtime's CloudWatch log.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from rayrl.agents.agentcore.launcher import SessionOutcome
from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, result_key
from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.config import AgentCoreConfig
from rayrl.rl.failures import AGENT_CRASHED, SERVICE_FAILED
from rayrl.types import Task


class SessionLauncher(Protocol):
    """What the harness needs from a launcher: RolloutLauncher itself, or a proxy to the run's one."""

    def run_session(self, payload: dict[str, Any], session_id: str, bucket: str, key: str,
                    budget_s: float | None = None) -> SessionOutcome: ...


def public_base_url(base_url: str, public_host: str | None) -> str:
    """The gateway URL as the agent must dial it: the bound host replaced by ``public_host``, port kept."""
    if not public_host:
        return base_url
    parts = urlsplit(base_url)
    netloc = public_host if parts.port is None else f"{public_host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class AgentCoreHarness(BaseHarness):
    """Runs the task's agent on AgentCore Runtime (or the local emulator) and reads back its result."""

    name = "agentcore"
    needs_sandbox = False  # the agent runs in its own microVM

    def __init__(self, launcher: SessionLauncher, cfg: AgentCoreConfig, exp_id: str) -> None:
        self.launcher = launcher
        self.cfg = cfg
        self.exp_id = exp_id

    def payload_for(self, task: Task, ctx: EpisodeContext) -> tuple[dict[str, Any], AgentRolloutConfig]:
        """The task's metadata (a shallow copy: the dataset never changes) plus ``rollout_config``."""
        key = result_key(self.cfg.s3_prefix, self.exp_id, task.task_id, ctx.session_id)
        rollout = AgentRolloutConfig(
            base_url=public_base_url(ctx.base_url, self.cfg.gateway_public_host),
            api_key=ctx.api_key,
            model=ctx.model,
            exp_id=self.exp_id,
            session_id=ctx.session_id,
            s3_bucket=self.cfg.s3_bucket,
            result_key=key,
            sampling={"temperature": ctx.temperature, "top_p": ctx.top_p, "max_tokens": ctx.max_tokens},
            max_turns=ctx.max_turns,
            timeout_s=max(1.0, min(self.cfg.session_timeout_s, ctx.time_left()) - 5.0),
        )
        payload = task.payload()
        payload[ROLLOUT_CONFIG_KEY] = rollout.to_dict()
        return payload, rollout

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        payload, rollout = self.payload_for(task, ctx)
        outcome = self.launcher.run_session(payload, ctx.session_id, rollout.s3_bucket, rollout.result_key,
                                            budget_s=max(0.0, ctx.time_left()))
        return to_agent_result(outcome)


def to_agent_result(outcome: SessionOutcome) -> AgentResult:
    """A session's outcome as the reward function sees it (the raw result object in ``info``)."""
    result = outcome.result or {}
    info = dict(result.get("info") or {})
    if "rewards" in result:
        info["rewards"] = result["rewards"]
    info["agentcore"] = {"session_id": outcome.session_id, "status": outcome.status,
                         "attempts": outcome.attempts, **{k: round(v, 3) for k, v in outcome.timings.items()}}
    turns = info.get("turns", 0)
    answer = result.get("final_answer")
    return AgentResult(
        final_answer=None if answer is None else str(answer),
        status="completed" if outcome.ok else "error",
        turns=int(turns) if isinstance(turns, (int, float)) else 0,
        error=outcome.error,
        # the agent itself reported failure: its crash; anything else (invoke, timeout, unreadable result)
        # is the service's
        failure=None if outcome.ok else (AGENT_CRASHED if outcome.status == "failed" else SERVICE_FAILED),
        info=info,
    )
