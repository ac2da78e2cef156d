"""One episode end to end: session, sandbox lease, agent, reward, samples.

``EpisodeRunner`` depends only on two small protocols, so a notebook can drive it with in-process
objects and the RolloutWorker actor with Ray handles. Every failure (agent crash, timeout, sandbox or
gateway error, reward error, no turns recorded) ends as an Episode with ``status="failed"``, its kind
(rayrl/rl/failures.py: infrastructure or the agent's) and its error; whatever was generated before the
failure is kept on the Episode, never dropped silently. An infrastructure failure gets no reward: it is
left out of training. The agent's own failure (it raised, reported an error, or made no LLM call) is
still scored by the reward function, which sees ``result.status == "error"``, and a reward function that
raises scores 0.0: such episodes count against the task and train (``is_scored``). An episode whose
session saw the engine or the gateway fail a call is an infrastructure failure even if the agent went
on: its trajectory was shaped by the failure, so its reward would mislead GRPO. The task's
``metadata.files`` are written into the sandbox before the agent starts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.config import RolloutConfig
from rayrl.gateway.sessions import SessionInfo
from rayrl.rl.failures import (
    AGENT_CRASHED,
    ENGINE_ERROR,
    INFRA_KINDS,
    JUDGE_FAILED,
    NO_TURNS,
    REWARD_FAILED,
    SANDBOX_FAILED,
    SERVICE_FAILED,
    SESSION_FAILED,
    TIMED_OUT,
    InfrastructureError,
    JudgeError,
    fail,
)
from rayrl.sandboxes.base import Sandbox, SandboxError
from rayrl.types import Episode, Sample, Task

logger = logging.getLogger("rayrl.rollout")


class SessionService(Protocol):
    def open_session(self, metadata: dict[str, Any]) -> SessionInfo: ...

    def session_stats(self, session_id: str) -> dict[str, Any]: ...

    def finish_session(
        self, session_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> list[Sample]: ...


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

    def _run_agent(self, task: Task, ctx: EpisodeContext) -> tuple[AgentResult, str | None]:
        """Run the harness in a thread and stop waiting at the deadline; returns the result and, when the
        harness did not finish normally, the failure kind (rayrl/rl/failures.py).

        A harness that overruns is abandoned; finishing its session right after makes the gateway
        refuse its further calls (409), so a looping agent stops at its next LLM call.
        """
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = self.harness.run(task, ctx)
            except BaseException as err:  # reported as the episode's error
                box["error"] = describe_error(err)
                box["kind"] = raised_kind(err) or AGENT_CRASHED

        thread = threading.Thread(target=target, name=f"agent-{task.task_id}", daemon=True)
        thread.start()
        thread.join(max(0.0, ctx.time_left()))
        if thread.is_alive():
            timed_out = f"episode timed out after {self.cfg.episode_timeout_s:.0f} s"
            return AgentResult(status="error", error=timed_out), TIMED_OUT
        if "error" in box:  # a sandbox that died or an InfrastructureError is not the agent's doing
            return AgentResult(status="error", error=box["error"]), box["kind"]
        result = box["result"]
        if result.status == "error":  # the harness reported the failure (a CLI that exited badly, ...)
            kind = result.failure or (TIMED_OUT if ctx.time_left() <= 0 else AGENT_CRASHED)
            return result, kind
        return result, None

    def run(self, task: Task, group_id: str, index: int = 0) -> Episode:
        started = time.monotonic()
        timings: dict[str, float] = {}
        metadata = {"task_id": task.task_id, "group_id": group_id, "index": index}
        session = self.sessions.open_session(metadata)
        episode = Episode(session_id=session.session_id, task_id=task.task_id, group_id=group_id)
        lease_id: str | None = None
        reward = 0.0
        result = AgentResult(status="error", error="not started")
        recorded: dict[str, Any] = {}  # what the gateway recorded of the session, for the guards
        failure: tuple[str, str] | None = None  # (kind, message)
        try:
            sandbox = None
            if self.sandboxes is not None:
                t0 = time.monotonic()
                try:
                    lease_id, sandbox = self.sandboxes.acquire()
                    write_task_files(sandbox, task)
                except Exception as err:
                    raise _Failed(SANDBOX_FAILED, f"{type(err).__name__}: {err}") from None
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
            result, kind = self._run_agent(task, ctx)
            timings["agent_s"] = time.monotonic() - t0
            if sandbox is not None and _wants_files(task):
                try:
                    result.info["files"] = collect_files(sandbox)
                except Exception as err:
                    raise _Failed(SANDBOX_FAILED, f"collecting the files failed: {type(err).__name__}: {err}") from None
            stats = self._session_stats(session.session_id)
            recorded = gateway_facts(stats)
            infra = _infra_error(stats)
            if infra is not None:  # the engine or gateway failed a call: the trajectory is not the policy's
                raise _Failed(ENGINE_ERROR, infra)
            if kind in INFRA_KINDS:
                raise _Failed(kind, result.error or kind)
            if not result.turns:  # a function or program agent does not count its calls: the gateway did
                result.turns = int(stats.get("api_calls", 0) or 0)
            if int(stats.get("turns", 0) or 0) > 0:  # the tool calls the model made, as the gateway recorded them
                result.tool_calls = int(stats.get("tool_calls", 0) or 0)
            if kind is not None:  # the agent's own failure: it still gets what the reward function gives
                failure = (kind, result.error or kind)
            t0 = time.monotonic()
            reward, reward_error = self._score(task, result)
            timings["reward_s"] = time.monotonic() - t0
            if reward_error is not None and failure is None:
                failure = (REWARD_FAILED, reward_error)
        except _Failed as err:
            failure = (err.kind, err.message)
        finally:
            if lease_id is not None and self.sandboxes is not None:
                try:
                    self.sandboxes.release(lease_id)
                except Exception as err:
                    logger.warning("sandbox lease %s release failed: %s", lease_id, err)
        try:
            episode.samples = self.sessions.finish_session(session.session_id, reward, {"reward": reward})
        except Exception as err:  # infrastructure: it takes the place of an agent's own failure
            if failure is None or failure[0] not in INFRA_KINDS:
                failure = (SESSION_FAILED, f"finishing the session failed: {err}")
        episode.reward = reward
        episode.info = {
            "agent_status": result.status,
            "turns": result.turns,
            "tool_calls": result.tool_calls,
            "tool_errors": result.tool_errors,
            "final_answer": (result.final_answer or "")[:500],
            "gateway": recorded,
        }
        if result.info.get("judge_calls"):  # what grading it cost: judge/* metrics
            episode.info["judge_calls"] = list(result.info["judge_calls"])
        breakdown = result.info.get("reward_breakdown")
        if breakdown:  # each reward function's own score (an environment's rubric): reward/<name> metrics
            episode.info["reward_breakdown"] = dict(breakdown)
        if isinstance(result.info.get("stderr"), str):  # a program agent's stderr, bounded (command_agent.py)
            episode.info["stderr"] = result.info["stderr"]
        if failure is None and not episode.samples:
            failure = (NO_TURNS, "no LLM turn was recorded for this episode")
        if failure is not None:
            fail(episode, *failure)
        timings["total_s"] = time.monotonic() - started
        episode.timings = timings
        return episode

    def _score(self, task: Task, result: AgentResult) -> tuple[float, str | None]:
        """``(reward, error)``: the reward function's score, or 0.0 and what went wrong when it raised or
        returned no finite number. A reward that raises InfrastructureError (or a SandboxError: its
        grading sandbox could not be had) fails the episode as infrastructure instead."""
        try:
            value = self.reward_fn(task, result)
            reward = float(value)
        except Exception as err:
            kind = raised_kind(err)
            if kind is not None:
                raise _Failed(kind, f"the reward function: {describe_error(err)}") from None
            return 0.0, describe_error(err)
        if not math.isfinite(reward):
            return 0.0, f"the reward function returned {value!r}"
        return reward, None

    def _session_stats(self, session_id: str) -> dict[str, Any]:
        """The session's counters; an unreachable gateway shard is an infrastructure failure."""
        try:
            return self.sessions.session_stats(session_id)
        except Exception as err:
            raise _Failed(SESSION_FAILED,
                          f"the gateway did not answer: {type(err).__name__}: {err}") from None


GATEWAY_FACTS = ("turns", "tool_calls", "tool_turns", "tool_parse_errors", "length_turns", "turn_cap_refusals",
                 "last_finish")


def gateway_facts(stats: dict[str, Any]) -> dict[str, Any]:
    """What the gateway recorded of a session that the guards read (rayrl/rl/guards.py): counts of its
    turns, tool calls, unparseable tool calls, turns cut at max_tokens, and drift events (summed over kinds)."""
    facts = {k: stats[k] for k in GATEWAY_FACTS if k in stats}
    drift = stats.get("drift")
    facts["drift"] = int(sum(drift.values())) if isinstance(drift, dict) else 0
    return facts


def _infra_error(stats: dict[str, Any]) -> str | None:
    """The first infrastructure error the gateway answered the session with, if any."""
    count = int(stats.get("infra_errors", 0) or 0)
    if count <= 0:
        return None
    return f"{count} LLM call(s) failed in the engine or gateway; first: {stats.get('infra_error')}"


def raised_kind(err: BaseException) -> str | None:
    """The infrastructure failure kind an exception from an agent or a reward stands for, or None when it
    is their own error."""
    if isinstance(err, SandboxError):
        return SANDBOX_FAILED
    if isinstance(err, JudgeError):
        return JUDGE_FAILED
    if isinstance(err, InfrastructureError):
        return SERVICE_FAILED
    return None


def describe_error(err: BaseException) -> str:
    """``Type: message (file:line)``, one line: the line is where it was raised, so the first log line
    that mentions the failure says where to look."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}{where}" if text else f"{type(err).__name__}{where}"


class _Failed(Exception):
    """An episode's failure, with its kind (rayrl/rl/failures.py), raised inside :meth:`EpisodeRunner.run`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def write_task_files(sandbox: Sandbox | None, task: Task) -> None:
    """Write the task's ``metadata.files`` (relative path -> text) into the sandbox before the agent starts:
    the state the task is about (examples/files, examples/swe). Any harness sees them."""
    files = task.metadata.get("files") if isinstance(task.metadata, dict) else None
    if not files:
        return
    if sandbox is None:
        raise ValueError("the task ships files but the harness runs without a sandbox")
    if not isinstance(files, dict):
        raise ValueError("metadata.files must map relative paths to text")
    for path, content in files.items():
        sandbox.write_file(str(path), str(content).encode())


COLLECT_MAX_FILES = 200
COLLECT_MAX_BYTES = 1 << 20
_LIST_FILES = ["python3", "-c", "import os\nfor b, ds, fs in os.walk('.'):\n    ds[:] = sorted(d for d in ds if not "
               "d.startswith('.'))\n    for f in sorted(fs):\n        if not f.startswith('.'): "
               "print(os.path.join(b, f)[2:])"]


def _wants_files(task: Task) -> bool:
    return isinstance(task.metadata, dict) and bool(task.metadata.get("collect_files"))


def collect_files(sandbox: Sandbox) -> dict[str, str]:
    """The text files the agent left in its working directory (dot files skipped; at most
    ``COLLECT_MAX_FILES`` files and ``COLLECT_MAX_BYTES`` in all): what a task with ``metadata.collect_files``
    hands to its reward in ``result.info["files"]`` (examples/swe)."""
    listing = sandbox.exec(_LIST_FILES, timeout=30)
    if listing.exit_code != 0:
        raise RuntimeError(f"listing the files failed: {listing.stderr.strip()[:200]}")
    files: dict[str, str] = {}
    total = 0
    for path in listing.stdout.splitlines()[:COLLECT_MAX_FILES]:
        data = sandbox.read_file(path)
        total += len(data)
        if total > COLLECT_MAX_BYTES:
            break
        files[path] = data.decode("utf-8", "replace")
    return files
