"""Trainer side: ``RolloutLauncher`` starts AgentCore sessions and collects their results from S3.

One session = one ``invoke_agent_runtime`` (boto3 ``bedrock-agentcore``) with the task's payload and
``payload["rollout_config"]``, then polling S3 for the result object the agent's executor writes.

Limits, all global to the launcher (a run has one: actors/agentcore_launcher.py):

- ``max_concurrent`` sessions in flight (from the invoke until the result or the timeout);
- ``acr_tps_limit`` invoke requests per second, retries included (rate_limit.RateLimiter);
- ``max_pool_connections`` in botocore's connection pool, so concurrent sessions reuse connections.

botocore's own retries are off for the invoke: every retry must take a rate-limiter slot. Throttling
(ThrottlingException, ServiceQuotaExceededException, any 429), 5xx responses and connection errors are
retried up to ``max_retries`` times with exponential backoff and full jitter; anything else fails the
session at once. A session that has no result ``session_timeout_s`` after its invoke is failed and
stopped (``stop_runtime_session``, best effort). Each failure is counted in ``stats()``; the launcher
never raises for a session's failure, it returns a failed ``SessionOutcome`` naming the session id.

``run_batch`` (notebooks, smoke tests; the pipeline runs sessions one per episode) returns
agentcore-rl-toolkit's shape: a :class:`BatchResult` that yields a :class:`BatchItem` per session as
sessions complete.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, check_session_id
from rayrl.agents.agentcore.rate_limit import RateLimiter
from rayrl.config import AgentCoreConfig

logger = logging.getLogger("rayrl.agentcore")
RATE_GUARD_S = 0.05  # delivery jitter the TPS limit absorbs, so it holds on AgentCore's clock (rate_limit.py)

_RETRYABLE_CODES = {
    "ThrottlingException", "ServiceQuotaExceededException", "TooManyRequestsException", "Throttling",
    "RetryableConflictException", "InternalServerException", "ServiceUnavailableException",
    "ServiceUnavailable", "InternalFailure", "RequestTimeout", "RequestTimeoutException",
}
_THROTTLE_CODES = {
    "ThrottlingException", "ServiceQuotaExceededException", "TooManyRequestsException", "Throttling",
}


@dataclass
class SessionOutcome:
    """How one session ended: the agent's result object, or why there is none."""

    session_id: str
    status: str  # completed | failed (agent reported) | invoke_failed | timeout | result_unreadable
    result: dict[str, Any] | None = None
    error: str | None = None
    attempts: int = 0  # invoke requests sent for this session
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, invoke_s, wait_s, total_s

    @property
    def ok(self) -> bool:
        return self.status == "completed"


@dataclass
class BatchItem:
    """One session of a batch: agentcore-rl-toolkit's ``BatchItem`` fields (``success``, ``result``,
    ``error``, ``index`` into the batch, ``elapsed`` seconds), plus the ``session_id`` (the
    runtimeSessionId, for CloudWatch) and the full ``outcome``."""

    success: bool
    result: dict[str, Any] | None
    error: str | None
    index: int
    elapsed: float
    session_id: str
    outcome: SessionOutcome

    @classmethod
    def of(cls, index: int, outcome: SessionOutcome) -> BatchItem:
        return cls(outcome.ok, outcome.result if outcome.ok else None, outcome.error, index,
                   outcome.timings.get("total_s", 0.0), outcome.session_id, outcome)


class InvokeError(RuntimeError):
    """The invoke failed for good (not retryable, or retries exhausted) after ``attempts`` requests."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


def classify(err: Exception) -> tuple[bool, bool, str]:
    """(retryable, throttled, description) of a botocore error."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        throttled = code in _THROTTLE_CODES or status == 429
        retryable = throttled or code in _RETRYABLE_CODES or status >= 500
        message = err.response.get("Error", {}).get("Message", "")
        return retryable, throttled, f"{code or 'HTTP ' + str(status)} ({status}): {message}"
    if isinstance(err, (ConnectionClosedError, EndpointConnectionError, ReadTimeoutError)):
        return True, False, f"{type(err).__name__}: {err}"
    return False, False, f"{type(err).__name__}: {err}"


def boto_clients(cfg: AgentCoreConfig, credentials: dict[str, str] | None = None) -> tuple[Any, Any]:
    """The AgentCore and S3 clients: one connection pool each, sized by ``max_pool_connections``."""
    import boto3
    from botocore.config import Config

    common = dict(region_name=cfg.region, **(credentials or {}))
    acr = boto3.client(
        "bedrock-agentcore",
        endpoint_url=cfg.endpoint_url,
        config=Config(
            max_pool_connections=cfg.max_pool_connections,
            retries={"total_max_attempts": 1, "mode": "standard"},  # ours, through the rate limiter
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
        ),
        **common,
    )
    s3 = boto3.client(
        "s3",
        endpoint_url=cfg.s3_endpoint_url,
        config=Config(
            max_pool_connections=cfg.max_pool_connections,
            retries={"max_attempts": 5, "mode": "standard"},
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
        ),
        **common,
    )
    return acr, s3


class RolloutLauncher:
    """Starts sessions on one agent runtime within the run's concurrency and request-rate limits."""

    def __init__(
        self,
        cfg: AgentCoreConfig,
        acr_client: Any = None,
        s3_client: Any = None,
        credentials: dict[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ) -> None:
        if acr_client is None or s3_client is None:
            acr, s3 = boto_clients(cfg, credentials)
            acr_client = acr_client or acr
            s3_client = s3_client or s3
        self.cfg = cfg
        self.acr = acr_client
        self.s3 = s3_client
        self.limiter = RateLimiter(cfg.acr_tps_limit, cfg.acr_burst, guard_s=RATE_GUARD_S)
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent)
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._in_flight = 0

    # -- bookkeeping -------------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._counts["peak_in_flight"] = max(self._counts["peak_in_flight"], self._in_flight)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def stats(self) -> dict[str, int]:
        """Counters since start: sessions by outcome, invoke requests, retries, throttles, peak in flight."""
        with self._lock:
            return {**self._counts, "in_flight": self._in_flight}

    def backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(backoff_max_s, backoff_base_s * 2**attempt)]."""
        cap = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * (2**attempt))
        return self._rng.uniform(0.0, cap)

    # -- one session -------------------------------------------------------------------------------

    def invoke(self, payload: dict[str, Any], session_id: str,
               deadline: float = float("inf")) -> tuple[dict[str, Any], int]:
        """``invoke_agent_runtime``, retried until ``deadline`` (monotonic); returns (reply, attempts)."""
        body = json.dumps(payload).encode()
        kwargs: dict[str, Any] = {
            "agentRuntimeArn": self.cfg.runtime_arn,
            "runtimeSessionId": session_id,
            "payload": body,
            "contentType": "application/json",
            "accept": "application/json",
        }
        if self.cfg.qualifier:
            kwargs["qualifier"] = self.cfg.qualifier
        attempt = 0
        while True:
            self.limiter.acquire()
            self._count("invoke_requests")
            try:
                response = self.acr.invoke_agent_runtime(**kwargs)
                raw = response["response"].read()
                try:
                    reply = json.loads(raw) if raw else {}
                except ValueError:
                    reply = {"raw": raw[:200].decode(errors="replace")}
                return (reply if isinstance(reply, dict) else {"reply": reply}), attempt + 1
            except Exception as err:
                retryable, throttled, description = classify(err)
                if throttled:
                    self._count("throttled")
                if not retryable or attempt >= self.cfg.max_retries:
                    suffix = f" after {attempt + 1} attempts" if retryable else ""
                    message = f"invoke_agent_runtime failed{suffix}: {description}"
                    raise InvokeError(message, attempt + 1) from None
                wait = self.backoff_s(attempt)
                if time.monotonic() + wait >= deadline:
                    raise InvokeError(f"invoke_agent_runtime: out of time after {attempt + 1} attempts: "
                                      f"{description}", attempt + 1) from None
                self._count("retries")
                self._sleep(wait)
                attempt += 1

    def poll_result(self, bucket: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        """The result object once it exists in S3, or None after ``timeout_s``."""
        from botocore.exceptions import ClientError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                obj = self.s3.get_object(Bucket=bucket, Key=key)
                return json.loads(obj["Body"].read())
            except ClientError as err:
                code = str(err.response.get("Error", {}).get("Code", ""))
                if code not in ("NoSuchKey", "404", "NotFound"):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._sleep(min(self.cfg.poll_interval_s, left))

    def _stop(self, session_id: str) -> None:
        """Free the runtime's microVM of a session that overran (best effort, rate limited)."""
        kwargs: dict[str, Any] = {"agentRuntimeArn": self.cfg.runtime_arn, "runtimeSessionId": session_id}
        if self.cfg.qualifier:
            kwargs["qualifier"] = self.cfg.qualifier
        try:
            self.limiter.acquire()
            self._count("stop_requests")
            self.acr.stop_runtime_session(**kwargs)
        except Exception as err:
            logger.debug("stop_runtime_session %s: %s", session_id, err)

    def run_session(
        self,
        payload: dict[str, Any],
        session_id: str,
        bucket: str,
        key: str,
        budget_s: float | None = None,
    ) -> SessionOutcome:
        """Invoke one session and wait for its result; never raises for the session's own failure.

        ``payload`` must already hold ``rollout_config``; ``budget_s`` (the episode's time left) caps
        the whole call, queueing for a concurrency slot included.
        """
        check_session_id(session_id)
        if ROLLOUT_CONFIG_KEY not in payload:
            raise ValueError(f"payload has no {ROLLOUT_CONFIG_KEY!r}")
        t_start = time.monotonic()
        end = t_start + budget_s if budget_s is not None else float("inf")
        outcome = SessionOutcome(session_id, "timeout")
        self._count("sessions")

        def failed(status: str, why: str) -> SessionOutcome:
            self._count("timeouts" if status == "timeout" else status)
            outcome.status, outcome.error = status, f"agentcore session {session_id}: {why}"
            return outcome

        if not self._slots.acquire(timeout=None if budget_s is None else max(0.0, end - t_start)):
            limit = self.cfg.max_concurrent
            return failed("timeout", f"no session slot free in time (max_concurrent={limit})")
        self._enter()
        try:
            outcome.timings["queue_s"] = time.monotonic() - t_start
            t0 = time.monotonic()
            try:
                reply, outcome.attempts = self.invoke(payload, session_id, end)
            except InvokeError as err:
                outcome.attempts = err.attempts
                return failed("invoke_failed", str(err))
            outcome.timings["invoke_s"] = time.monotonic() - t0
            if reply.get("error"):
                return failed("invoke_failed", f"the agent refused: {reply['error']}")
            wait = max(0.0, min(self.cfg.session_timeout_s, end - time.monotonic()))
            t0 = time.monotonic()
            try:
                result = self.poll_result(bucket, key, wait)
            except Exception as err:
                return failed("result_unreadable", f"reading s3://{bucket}/{key}: {err}")
            outcome.timings["wait_s"] = time.monotonic() - t0
            if result is None:
                self._stop(session_id)
                return failed("timeout", f"no result at s3://{bucket}/{key} {wait:.0f} s after the invoke")
            if not isinstance(result, dict):
                return failed("result_unreadable", "the result is not a JSON object")
            outcome.result = result
            if result.get("status") == "completed":
                self._count("sessions_completed")
                outcome.status = "completed"
                return outcome
            self._count("sessions_failed")
            outcome.status, outcome.error = "failed", f"agentcore session {session_id}: {result.get('error')}"
            return outcome
        finally:
            outcome.timings["total_s"] = time.monotonic() - t_start
            self._leave()
            self._slots.release()

    def run_batch(self, items: list[tuple[dict[str, Any], str, str, str]],
                  budget_s: float | None = None) -> BatchResult:
        """Many sessions (``(payload, session_id, bucket, key)`` each) within the launcher's limits; they
        start when the result is iterated (see :class:`BatchResult`)."""
        return BatchResult(self, items, budget_s)


class BatchResult:
    """Iterating runs the batch and yields a :class:`BatchItem` per session in completion order
    (``item.index`` gives the input order), as agentcore-rl-toolkit's ``BatchResult`` does; iterating
    again yields the same items without running anything. Each failed session is logged once, with its
    full session id, and the batch ends with one summary line. Leaving the loop early lets the running
    sessions finish and starts no more."""

    def __init__(self, launcher: RolloutLauncher, items: list[tuple[dict[str, Any], str, str, str]],
                 budget_s: float | None) -> None:
        self.launcher = launcher
        self.items = list(items)
        self.budget_s = budget_s
        self._done: list[BatchItem] | None = None

    def __iter__(self) -> Iterator[BatchItem]:
        if self._done is not None:
            yield from self._done
            return
        done: list[BatchItem] = []
        launcher, budget = self.launcher, self.budget_s
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(self.items), launcher.cfg.max_concurrent)))
        try:
            futures = {pool.submit(launcher.run_session, *item, budget_s=budget): i
                       for i, item in enumerate(self.items)}
            for future in as_completed(futures):
                item = BatchItem.of(futures[future], future.result())
                if not item.success:
                    logger.warning("batch session %d failed (%s): %s", item.index, item.outcome.status, item.error)
                done.append(item)
                yield item
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        self._done = done
        failed = sum(not i.success for i in done)
        logger.info("batch: %d sessions, %d succeeded, %d failed", len(done), len(done) - failed, failed)
