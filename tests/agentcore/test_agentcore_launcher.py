"""RolloutLauncher against the FAKE AgentCore Runtime, the scripted agent app and moto S3.

Throttling is measured where the service would see it: the emulator records each request's arrival.
Assertions are on counts (requests per window, attempts, sessions), never on durations.
"""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
from _agentcore_kit import BUCKET, CREDS, REGION, max_per_window

from rayrl.agents.agentcore.emulator import DEFAULT_LOCAL_ARN, FakeAgentCoreRuntime, Faults
from rayrl.agents.agentcore.launcher import RolloutLauncher
from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, result_key
from rayrl.config import AgentCoreConfig


@contextmanager
def fake_runtime(loop_thread, agent_url: str, **faults: Any) -> Iterator[FakeAgentCoreRuntime]:
    fake = FakeAgentCoreRuntime(agent_url, DEFAULT_LOCAL_ARN, Faults(**faults))
    loop_thread.run(fake.start())
    try:
        yield fake
    finally:
        loop_thread.run(fake.stop())


def launcher_for(fake: FakeAgentCoreRuntime, moto_url: str, **overrides: Any) -> RolloutLauncher:
    settings = dict(runtime_arn=DEFAULT_LOCAL_ARN, region=REGION, endpoint_url=fake.url, s3_bucket=BUCKET,
                    s3_endpoint_url=moto_url, max_concurrent=16, acr_tps_limit=50.0, poll_interval_s=0.1,
                    session_timeout_s=30.0, backoff_base_s=0.01, backoff_max_s=0.05, max_pool_connections=32)
    settings.update(overrides)
    return RolloutLauncher(AgentCoreConfig(**settings), credentials=CREDS, seed=0)


def session(behaviour: str = "echo", **payload: Any) -> tuple[dict[str, Any], str, str, str]:
    """(payload with rollout_config, session id, bucket, key) for one session of the scripted agent."""
    sid = f"s0-{uuid.uuid4().hex}"
    key = result_key("tests", "exp", "task-1", sid)
    rollout = AgentRolloutConfig(base_url="http://127.0.0.1:9/v1", api_key="rrl-token", model="m", exp_id="exp",
                            session_id=sid, s3_bucket=BUCKET, result_key=key,
                            sampling={"temperature": 0.5}, timeout_s=20.0)
    return {"behaviour": behaviour, **payload, ROLLOUT_CONFIG_KEY: rollout.to_dict()}, sid, BUCKET, key



def test_session_result_round_trip(loop_thread, agent_app, moto_s3, s3_client):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3)
        payload, sid, bucket, key = session(answer=42)
        outcome = launcher.run_session(payload, sid, bucket, key)
    assert outcome.ok and outcome.attempts == 1, outcome
    result = outcome.result
    assert result["final_answer"] == "42" and result["session_id"] == sid and result["status"] == "completed"
    assert result["info"]["payload_seen"] == {"behaviour": "echo", "answer": 42}  # rollout_config is not the agent's
    assert result["info"]["rollout_seen"] == {"model": "m", "session_id": sid, "sampling": {"temperature": 0.5}}
    assert result["timings"]["agent_s"] >= 0
    stored = json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert stored == result
    assert [r["session_id"] for r in fake.requests] == [sid]


def _paced_batch(loop_thread, agent_app, moto_s3, limit: int) -> tuple[list, list[float], list[float], dict]:
    """30 sessions through a launcher limited to ``limit`` per second: outcomes, the limiter's grant times,
    the emulator's arrival times and the launcher's stats."""
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3, acr_tps_limit=float(limit), max_concurrent=32)
        grants: list[float] = []
        acquire = launcher.limiter.acquire
        launcher.limiter.acquire = lambda: grants.append(acquire()) or grants[-1]  # record each grant
        outcomes = list(launcher.run_batch([session(answer=i) for i in range(30)]))
        arrivals = [r["t"] for r in fake.requests if r["op"] == "invoke"]
    return outcomes, grants, arrivals, launcher.stats()


def test_launcher_never_exceeds_acr_tps_limit(loop_thread, agent_app, moto_s3):
    limit = 8
    outcomes, grants, arrivals, stats = _paced_batch(loop_thread, agent_app, moto_s3, limit)
    assert all(o.success for o in outcomes)
    assert len(arrivals) == len(grants) == 30 and stats["invoke_requests"] == 30
    assert max_per_window(grants) == limit  # exact where the launcher sends: the limit is reached, never passed
    assert max_per_window(grants, 2.0) <= 2 * limit  # no bursts after idle spells either


@pytest.mark.slow  # arrival times are wall-clock delivery: on a loaded 2-core machine a request can be held
# for most of a second between its grant and the emulator, so this is checked on a quiet machine only
def test_the_tps_limit_holds_at_the_emulator_too(loop_thread, agent_app, moto_s3):
    limit = 8
    outcomes, _, arrivals, _ = _paced_batch(loop_thread, agent_app, moto_s3, limit)
    assert all(o.success for o in outcomes)
    # the limiter's 50 ms guard absorbs loopback delivery jitter
    assert max_per_window(arrivals) <= limit
    assert max_per_window(arrivals, 2.0) <= 2 * limit


def test_throttling_and_5xx_are_retried_with_backoff(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app, throttle_first=2, error_first=1) as fake:
        launcher = launcher_for(fake, moto_s3, max_retries=4)
        outcomes = list(launcher.run_batch([session(answer=i) for i in range(4)]))
        statuses = [r["status"] for r in fake.requests]
    assert all(o.success for o in outcomes), [o.error for o in outcomes]
    assert [o.outcome.attempts for o in outcomes] == [4, 4, 4, 4]  # 429, 429, 500, then through
    assert sorted(statuses).count(429) == 8 and statuses.count(500) == 4 and statuses.count(200) == 4
    stats = launcher.stats()
    assert stats["throttled"] == 8 and stats["retries"] == 12 and stats["sessions_completed"] == 4


def test_service_quota_throttling_recovers(loop_thread, agent_app, moto_s3):
    """A launcher configured above the account's real quota gets 429s, backs off and still finishes."""
    with fake_runtime(loop_thread, agent_app, tps_limit=3) as fake:
        launcher = launcher_for(fake, moto_s3, acr_tps_limit=20.0, max_retries=10, backoff_base_s=0.2,
                                backoff_max_s=1.0)
        outcomes = list(launcher.run_batch([session(answer=i) for i in range(12)]))
    assert all(o.success for o in outcomes), [o.error for o in outcomes]
    assert launcher.stats()["throttled"] > 0
    assert sum(r["status"] == 200 for r in fake.requests) == 12


def test_retries_exhausted_and_non_retryable_errors_fail_the_session(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app, throttle_first=5) as fake:
        launcher = launcher_for(fake, moto_s3, max_retries=2)
        payload, sid, bucket, key = session()
        outcome = launcher.run_session(payload, sid, bucket, key)
    assert outcome.status == "invoke_failed" and outcome.attempts == 3
    assert sid in outcome.error and "ThrottlingException" in outcome.error and "after 3 attempts" in outcome.error
    assert len(fake.requests) == 3

    with fake_runtime(loop_thread, agent_app) as fake:
        wrong = launcher_for(fake, moto_s3, runtime_arn=DEFAULT_LOCAL_ARN + "-other")
        payload, sid, bucket, key = session()
        outcome = wrong.run_session(payload, sid, bucket, key)
    assert outcome.status == "invoke_failed" and "ResourceNotFoundException" in outcome.error
    assert outcome.attempts == 1 and len(fake.requests) == 1  # not retried
    assert wrong.stats()["invoke_failed"] == 1

    with fake_runtime(loop_thread, agent_app, throttle_first=50) as fake:  # retries stop at the budget
        slow = launcher_for(fake, moto_s3, max_retries=50, backoff_base_s=0.2, backoff_max_s=0.2)
        payload, sid, bucket, key = session()
        outcome = slow.run_session(payload, sid, bucket, key, budget_s=1.0)
    assert outcome.status == "invoke_failed" and "out of time" in outcome.error and outcome.attempts < 50


def test_bad_rollout_config_is_a_4xx_from_the_agent(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3)
        payload, sid, bucket, key = session()
        del payload[ROLLOUT_CONFIG_KEY]["result_key"]
        outcome = launcher.run_session(payload, sid, bucket, key)
    assert outcome.status == "invoke_failed"
    assert "RuntimeClientError" in outcome.error and "result_key" in outcome.error
    assert len(fake.requests) == 1


def test_agent_crash_is_a_failed_result_not_a_lost_session(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3)
        payload, sid, bucket, key = session("crash")
        outcome = launcher.run_session(payload, sid, bucket, key)
    assert outcome.status == "failed" and outcome.result["status"] == "failed"
    assert "agent crashed: RuntimeError: scripted crash" in outcome.result["error"]
    assert sid in outcome.error
    assert launcher.stats()["sessions_failed"] == 1


def test_session_timeout_fails_and_stops_the_session(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3, session_timeout_s=0.5)
        payload, sid, bucket, key = session("sleep", seconds=3)
        outcome = launcher.run_session(payload, sid, bucket, key)
        stopped = list(fake.stopped_sessions)
    assert outcome.status == "timeout" and sid in outcome.error and "no result" in outcome.error
    assert stopped == [sid]  # stop_runtime_session frees the runtime's microVM
    assert launcher.stats()["timeouts"] == 1

    with fake_runtime(loop_thread, agent_app) as fake:  # the caller's budget (the episode's time left) wins
        launcher = launcher_for(fake, moto_s3, session_timeout_s=30)
        payload, sid, bucket, key = session("sleep", seconds=3)
        assert launcher.run_session(payload, sid, bucket, key, budget_s=0.5).status == "timeout"


def test_max_concurrent_bounds_sessions_in_flight(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3, max_concurrent=3)
        group = uuid.uuid4().hex
        outcomes = list(launcher.run_batch([session("sleep", seconds=0.4, group=group) for _ in range(9)]))
    assert all(o.success for o in outcomes)
    assert launcher.stats()["peak_in_flight"] == 3
    # the agent app itself never ran more than 3 of these sessions at once
    assert max(o.result["info"]["peak_active"] for o in outcomes) <= 3


def test_backoff_is_exponential_with_full_jitter(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3, backoff_base_s=0.5, backoff_max_s=4.0)
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (6, 4.0)]:
        waits = [launcher.backoff_s(attempt) for _ in range(200)]
        assert all(0.0 <= w <= cap for w in waits)
        assert max(waits) > 0.8 * cap and min(waits) < 0.2 * cap  # spread over the whole range


def test_session_id_rule_is_checked_before_any_request(loop_thread, agent_app, moto_s3):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3)
        payload, _, bucket, key = session()
        with pytest.raises(ValueError, match="runtimeSessionId"):
            launcher.run_session(payload, "short", bucket, key)
        assert fake.requests == []
