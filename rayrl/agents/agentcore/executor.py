"""Agent side: the rollout executor an agent author wraps around an agent function.

    from rayrl.agents.agentcore import rollout_executor

    @rollout_executor
    def solve(payload: dict, rollout: RolloutContext) -> str | dict:
        client = rollout.openai_client()          # the gateway, with this session's token
        reply = client.chat.completions.create(model=rollout.model, messages=[...], **rollout.sampling)
        return reply.choices[0].message.content   # or {"final_answer": ..., "rewards": ..., ...}

    if __name__ == "__main__":
        solve.run()                               # serves GET /ping and POST /invocations on :8080

It is not a multi-request agent server: AgentCore starts one microVM per session, and the executor runs
the agent once for it. ``/invocations`` reads ``payload["rollout_config"]``, starts the agent in a
background thread and answers at once (``{"status": "processing", ...}``), so the invoke never holds a
connection for the whole episode; ``/ping`` reports ``HealthyBusy`` while the agent runs, which keeps the
session alive. When the agent returns, raises or overruns its time, exactly one result object goes to
S3 (status, final answer, error, timings): a crash is a failed result, never a lost session.

The HTTP app is the ``bedrock-agentcore`` SDK's ``BedrockAgentCoreApp`` (the same ``/ping`` and
``/invocations`` contract as the managed runtime); boto3 writes the result, so its usual configuration
applies (``AWS_ENDPOINT_URL_S3`` points it at a local moto server in local mode).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, AgentRolloutConfigError

logger = logging.getLogger("rayrl.agentcore.executor")

_RESULT_FIELDS = ("final_answer", "rewards", "status", "error")


@dataclass
class RolloutContext:
    """What the agent function gets besides its payload: the gateway and this session's settings."""

    base_url: str
    api_key: str
    model: str
    exp_id: str
    session_id: str
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature / top_p / max_tokens for each call
    max_turns: int = 8
    deadline: float = float("inf")  # time.monotonic() by which the agent should have stopped

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client for the gateway (no SDK retries: a retry records a second turn)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", max(1.0, self.time_left()))
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


AgentFn = Callable[[dict[str, Any], RolloutContext], Any]


def _normalise(returned: Any) -> dict[str, Any]:
    """The agent's return value as result fields: a str is the final answer; a dict may add rewards/info."""
    if returned is None or isinstance(returned, str):
        return {"status": "completed", "final_answer": returned}
    if isinstance(returned, dict):
        out = {"status": returned.get("status", "completed"), "final_answer": returned.get("final_answer")}
        if "rewards" in returned:
            out["rewards"] = returned["rewards"]
        if returned.get("error"):
            out["error"] = str(returned["error"])
        info = {k: v for k, v in returned.items() if k not in _RESULT_FIELDS}
        if info:
            out["info"] = info
        if out["status"] not in ("completed", "failed"):
            out["status"] = "failed"
            out["error"] = f"agent returned status {returned.get('status')!r}"
        if out["final_answer"] is not None:
            out["final_answer"] = str(out["final_answer"])
        return out
    return {"status": "completed", "final_answer": str(returned)}


class RolloutExecutor:
    """Runs one agent function once per AgentCore session and writes its result to S3."""

    def __init__(self, fn: AgentFn, s3_client: Any = None, s3_write_attempts: int = 5) -> None:
        from bedrock_agentcore.runtime import BedrockAgentCoreApp

        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "agent")
        self.__doc__ = getattr(fn, "__doc__", None)
        self._s3 = s3_client
        self._lock = threading.Lock()  # guards the lazy S3 client and the seen-sessions set
        self.s3_write_attempts = s3_write_attempts
        self.app = BedrockAgentCoreApp()
        self.app.entrypoint(self._invocation)
        self.app.logger.setLevel(logging.WARNING)  # the SDK logs every request and task at INFO
        self._seen: set[str] = set()  # session ids already run (one rollout per session)

    def __call__(self, payload: dict[str, Any], rollout: RolloutContext) -> Any:
        """Calling the executor calls the agent function directly (for tests and notebooks)."""
        return self.fn(payload, rollout)

    # -- /invocations ----------------------------------------------------------------------------

    def _invocation(self, payload: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            cfg = AgentRolloutConfig.from_payload(payload)
        except AgentRolloutConfigError as err:
            return JSONResponse({"error": "bad rollout_config", "details": str(err)}, status_code=400)
        with self._lock:  # invocations run on a thread pool: check and mark the session at once
            repeated = cfg.session_id in self._seen
            self._seen.add(cfg.session_id)
        if repeated:
            return JSONResponse({"error": f"session {cfg.session_id} already ran"}, status_code=409)
        agent_payload = {k: v for k, v in payload.items() if k != ROLLOUT_CONFIG_KEY}
        task_id = self.app.add_async_task("rollout", {"session_id": cfg.session_id})
        thread = threading.Thread(target=self._run, args=(cfg, agent_payload, task_id), daemon=True,
                                  name=f"rollout-{cfg.session_id[:12]}")
        thread.start()
        return {"status": "processing", "session_id": cfg.session_id, "s3_bucket": cfg.s3_bucket,
                "result_key": cfg.result_key}

    # -- one rollout -------------------------------------------------------------------------------

    def _run(self, cfg: AgentRolloutConfig, payload: dict[str, Any], task_id: int) -> None:
        started_at = time.time()
        t0 = time.monotonic()
        result = self.execute(cfg, payload)
        result["timings"] = {"agent_s": time.monotonic() - t0, "started_at": started_at,
                             "finished_at": time.time()}
        try:
            self._write_result(cfg, result)
        finally:
            self.app.complete_async_task(task_id)

    def execute(self, cfg: AgentRolloutConfig, payload: dict[str, Any]) -> dict[str, Any]:
        """Run the agent under its time limit; every outcome becomes a result dict (never raises)."""
        ctx = RolloutContext(
            base_url=cfg.base_url, api_key=cfg.api_key, model=cfg.model, exp_id=cfg.exp_id,
            session_id=cfg.session_id, sampling=dict(cfg.sampling), max_turns=cfg.max_turns,
            deadline=time.monotonic() + cfg.timeout_s,
        )
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["returned"] = self.fn(payload, ctx)
            except BaseException as err:  # the agent's bug becomes a failed result
                box["error"] = f"{type(err).__name__}: {err}"
                logger.warning("agent failed in session %s:\n%s", cfg.session_id,
                               traceback.format_exc(limit=8))

        worker = threading.Thread(target=target, daemon=True, name=f"agent-{cfg.session_id[:12]}")
        worker.start()
        worker.join(max(0.0, cfg.timeout_s))
        base = {"session_id": cfg.session_id, "exp_id": cfg.exp_id, "final_answer": None, "error": None}
        if worker.is_alive():
            return {**base, "status": "failed", "error": f"agent timed out after {cfg.timeout_s:.0f} s"}
        if "error" in box:
            return {**base, "status": "failed", "error": f"agent crashed: {box['error']}"}
        try:
            return {**base, **_normalise(box["returned"])}
        except Exception as err:  # an odd return value is the agent's failure too
            return {**base, "status": "failed", "error": f"bad agent return value: {err}"}

    def _client(self) -> Any:
        with self._lock:
            if self._s3 is None:
                import boto3
                from botocore.config import Config

                self._s3 = boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))
            return self._s3

    def _write_result(self, cfg: AgentRolloutConfig, result: dict[str, Any]) -> None:
        """Put the result object; retried, because a result that never arrives costs the trainer a timeout."""
        body = json.dumps(result, default=str).encode()
        for attempt in range(self.s3_write_attempts):
            try:
                self._client().put_object(Bucket=cfg.s3_bucket, Key=cfg.result_key, Body=body,
                                          ContentType="application/json")
                return
            except Exception as err:
                if attempt == self.s3_write_attempts - 1:
                    logger.error("session %s: result not written to s3://%s/%s: %s", cfg.session_id,
                                 cfg.s3_bucket, cfg.result_key, err)
                    return
                time.sleep(min(8.0, 0.5 * 2**attempt))

    # -- serving -----------------------------------------------------------------------------------

    def run(self, port: int | None = None, host: str | None = None) -> None:
        """Serve ``/ping`` and ``/invocations`` (port: $PORT or 8080, as AgentCore expects)."""
        port = int(port or os.environ.get("PORT", 8080))
        self.app.run(port=port, host=host or os.environ.get("HOST"))


def rollout_executor(fn: AgentFn) -> RolloutExecutor:
    """Decorator: ``fn(payload, rollout) -> answer`` becomes an AgentCore app running it once per session."""
    return RolloutExecutor(fn)
