"""One episode end to end: session, sandbox lease, agent, reward, samples.

``EpisodeRunner`` depends only on two small protocols, so a notebook can drive it with in-process
objects and the RolloutWorker actor with Ray handles. Every failure (agent crash, timeout, sandbox or
gateway error, no turns recorded) ends as an Episode with ``status="failed"`` and its error; whatever
was generated before the failure is kept on the Episode, never dropped silently.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.config import RolloutConfig
from rayrl.gateway.sessions import SessionInfo
from rayrl.sandboxes.base import Sandbox, SandboxError
from rayrl.types import Episode, Sample, Task

logger = logging.getLogger("rayrl.rollout")


class SessionService(Protocol):
    def open_session(self, metadata: dict[str, Any]) -> SessionInfo: ...

    def finish_session(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list[Sample]: ...


class SandboxService(Protocol):
    def acquire(self) -> tuple[str, Sandbox]: ...

    def release(self, lease_id: str) -> None: ...


class EpisodeRunner:
    """Runs one agent on one task and returns an Episode (never raises for episode failures)."""

    def __init__(
        self,
        harness: BaseHarness,
        reward_fn: Callable[[Task, AgentResult], float],
        sessions: SessionService,
        sandboxes: SandboxService | None,
        cfg: RolloutConfig,
        model_name: str,
    ) -> None:
        self.harness = harness
        self.reward_fn = reward_fn
        self.sessions = sessions
        self.sandboxes = sandboxes
        self.cfg = cfg
        self.model_name = model_name

    def _run_agent(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        """Run the harness in a thread and stop waiting at the deadline.

        A harness that overruns is abandoned; finishing its session right after makes the gateway
        refuse its further calls (409), so a looping agent stops at its next LLM call.
        """
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = self.harness.run(task, ctx)
            except BaseException as err:  # reported as the episode's error
                box["error"] = f"{type(err).__name__}: {err}"
                box["sandbox"] = isinstance(err, SandboxError)
                box["trace"] = traceback.format_exc(limit=5)

        thread = threading.Thread(target=target, name=f"agent-{task.task_id}", daemon=True)
        thread.start()
        thread.join(max(0.0, ctx.time_left()))
        if thread.is_alive():
            return AgentResult(status="error", error=f"episode timed out after {self.cfg.episode_timeout_s:.0f} s")
        if "error" in box:
            # a sandbox that died is infrastructure, not the agent's doing: its own failure kind
            kind = "sandbox failed" if box["sandbox"] else "agent crashed"
            return AgentResult(status="error", error=f"{kind}: {box['error']}")
        return box["result"]

    def run(self, task: Task, group_id: str, index: int = 0) -> Episode:
        started = time.monotonic()
        timings: dict[str, float] = {}
        metadata = {"task_id": task.task_id, "group_id": group_id, "index": index}
        session = self.sessions.open_session(metadata)
        episode = Episode(session_id=session.session_id, task_id=task.task_id, group_id=group_id)
        lease_id: str | None = None
        reward = 0.0
        result = AgentResult(status="error", error="not started")
        try:
            sandbox = None
            if self.sandboxes is not None:
                t0 = time.monotonic()
                lease_id, sandbox = self.sandboxes.acquire()
                timings["sandbox_acquire_s"] = time.monotonic() - t0
            ctx = EpisodeContext(
                base_url=session.base_url,
                api_key=session.token,
                model=self.model_name,
                sandbox=sandbox,
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                max_tokens=self.cfg.max_tokens,
                max_turns=self.cfg.max_turns,
                deadline=started + self.cfg.episode_timeout_s,
                system_prompt=self.cfg.system_prompt,
                session_id=session.session_id,
                episode_index=index,
            )
            t0 = time.monotonic()
            result = self._run_agent(task, ctx)
            timings["agent_s"] = time.monotonic() - t0
            if result.status != "error":
                t0 = time.monotonic()
                reward = float(self.reward_fn(task, result))
                timings["reward_s"] = time.monotonic() - t0
        except Exception as err:  # sandbox or reward failure: the episode fails, the step goes on
            result = AgentResult(status="error", error=f"{type(err).__name__}: {err}")
        finally:
            if lease_id is not None and self.sandboxes is not None:
                try:
                    self.sandboxes.release(lease_id)
                except Exception as err:
                    logger.warning("sandbox lease %s release failed: %s", lease_id, err)
        try:
            episode.samples = self.sessions.finish_session(session.session_id, reward, {"reward": reward})
        except Exception as err:
            result = AgentResult(status="error", error=f"finishing the session failed: {err}")
        episode.reward = reward
        episode.info = {
            "agent_status": result.status,
            "turns": result.turns,
            "tool_calls": result.tool_calls,
            "tool_errors": result.tool_errors,
            "final_answer": (result.final_answer or "")[:500],
        }
        if result.status == "error":
            episode.status, episode.error = "failed", result.error
        elif not episode.samples:
            episode.status, episode.error = "failed", "no LLM turn was recorded for this episode"
        timings["total_s"] = time.monotonic() - started
        episode.timings = timings
        return episode
