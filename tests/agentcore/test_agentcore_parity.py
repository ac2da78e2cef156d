"""agentcore-rl-toolkit parity (issue 19): ``run_batch``'s BatchResult / BatchItem shape and its log lines,
the pool sizes reaching botocore and the limiter from a run config, and an agent that never calls the
LLM failing its episode with ``no_turns``.

Real parts: the FAKE AgentCore Runtime, the scripted agent app process, moto S3, the gateway on loopback.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from _agentcore_kit import BUCKET, CREDS, REGION
from test_agentcore_launcher import fake_runtime, launcher_for, session

from rayrl.agents.agentcore import BatchItem, BatchResult
from rayrl.agents.agentcore.emulator import DEFAULT_LOCAL_ARN
from rayrl.agents.agentcore.harness import AgentCoreHarness
from rayrl.agents.agentcore.launcher import RolloutLauncher
from rayrl.agents.episode import EpisodeRunner
from rayrl.config import AgentCoreConfig, GatewayConfig, RolloutConfig, TrajectoryConfig, load_config
from rayrl.rl.failures import NO_TURNS
from rayrl.types import Task


def test_run_batch_yields_toolkit_items_and_logs_each_failure_once(loop_thread, agent_app, moto_s3, caplog):
    with fake_runtime(loop_thread, agent_app) as fake:
        launcher = launcher_for(fake, moto_s3, session_timeout_s=5.0)
        batch = [session(answer=0), session("crash"), session(answer=2), session(answer=3)]
        with caplog.at_level(logging.INFO, logger="rayrl.agentcore"):
            result = launcher.run_batch(batch)
            assert isinstance(result, BatchResult) and fake.requests == []  # nothing runs before iterating
            items = list(result)
        requests = len(fake.requests)
        assert list(result) == items and len(fake.requests) == requests  # iterating again replays
    assert all(isinstance(i, BatchItem) for i in items)
    assert sorted(i.index for i in items) == [0, 1, 2, 3]  # completion order; index gives the input's
    by_index = {i.index: i for i in items}
    for index in (0, 2, 3):
        item = by_index[index]
        assert item.success and item.error is None and item.result["final_answer"] == str(index)
        assert item.session_id == batch[index][1] and item.elapsed >= 0.0
    crashed = by_index[1]
    assert not crashed.success and crashed.result is None and crashed.outcome.status == "failed"
    assert crashed.session_id in crashed.error and "scripted crash" in crashed.error
    # one WARNING per failed session, naming its full runtimeSessionId; one summary line per batch
    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failures) == 1 and crashed.session_id in failures[0].getMessage()
    assert all(i.session_id not in failures[0].getMessage() for i in items if i.success)
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch:")]
    assert summaries == ["batch: 4 sessions, 3 succeeded, 1 failed"]


def test_pool_sizes_reach_botocore_and_the_limiter(loop_thread, agent_app, moto_s3):
    """From the run config (as the AgentCoreLauncher actor builds it) to the objects that enforce it."""
    with fake_runtime(loop_thread, agent_app) as fake:
        cfg = load_config(None, [f"agentcore.runtime_arn={DEFAULT_LOCAL_ARN}", f"agentcore.s3_bucket={BUCKET}",
                                 f"agentcore.region={REGION}", f"agentcore.endpoint_url={fake.url}",
                                 f"agentcore.s3_endpoint_url={moto_s3}", "agentcore.max_pool_connections=7",
                                 "agentcore.max_concurrent=2", "agentcore.acr_tps_limit=30.5", "agentcore.acr_burst=3",
                                 "agentcore.poll_interval_s=0.1"])
        launcher = RolloutLauncher(cfg.agentcore, credentials=CREDS)
        for client in (launcher.acr, launcher.s3):
            assert client.meta.config.max_pool_connections == 7
        assert launcher.acr.meta.config.retries["total_max_attempts"] == 1  # every retry is ours, rate limited
        assert (launcher.limiter.rate, launcher.limiter.burst, launcher.limiter.per_window) == (30.5, 3, 30)
        group = uuid.uuid4().hex
        items = list(launcher.run_batch([session("sleep", seconds=0.3, group=group) for _ in range(6)]))
    assert all(i.success for i in items)
    assert launcher.stats()["peak_in_flight"] == 2  # max_concurrent reached the session semaphore
    assert max(i.result["info"]["peak_active"] for i in items) <= 2


class _GatewaySessions:
    """The SessionService protocol over a gateway on the test's loop (what the Ray actor does remotely)."""

    def __init__(self, gateway: Any, loop_thread: Any) -> None:
        self.gateway, self.loop = gateway, loop_thread

    def open_session(self, metadata: dict[str, Any]) -> Any:
        return self.gateway.open_session(metadata)

    def session_stats(self, session_id: str) -> dict[str, Any]:
        return self.gateway.session_stats(session_id)

    def finish_session(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list:
        return self.loop.run(self.gateway.finish_session(session_id, reward, metadata))


@pytest.fixture
def gateway(loop_thread, tiny_tokenizer):
    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway

    router = Router(["http://127.0.0.1:9"])  # never called: the agent below makes no LLM call
    gw = Gateway(GatewayConfig(), TrajectoryConfig(), tiny_tokenizer, router,
                 model_name="tiny")
    loop_thread.run(gw.start())
    yield gw
    loop_thread.run(gw.stop())
    loop_thread.run(router.close())


def test_agent_that_never_calls_the_llm_fails_with_no_turns(loop_thread, agent_app, moto_s3, gateway):
    with fake_runtime(loop_thread, agent_app) as fake:
        settings = AgentCoreConfig(runtime_arn=DEFAULT_LOCAL_ARN, region=REGION, endpoint_url=fake.url,
                                   s3_bucket=BUCKET, s3_endpoint_url=moto_s3, poll_interval_s=0.1)
        harness = AgentCoreHarness(RolloutLauncher(settings, credentials=CREDS), settings, exp_id="exp-nt")
        runner = EpisodeRunner(harness, lambda task, result: 1.0, _GatewaySessions(gateway, loop_thread), None,
                               RolloutConfig(agent="agentcore", episode_timeout_s=30), "tiny")
        episode = runner.run(Task(prompt="p", metadata={"behaviour": "echo", "answer": 7}), "g0")
        invoked = [r["session_id"] for r in fake.requests if r["op"] == "invoke"]
    assert episode.info["agent_status"] == "completed" and episode.info["final_answer"] == "7"
    assert episode.status == "failed" and episode.failure == NO_TURNS and episode.samples == []
    assert episode.error == "no_turns: no LLM turn was recorded for this episode"
    assert invoked == [episode.session_id]  # the gateway session is the runtimeSessionId (CloudWatch)
    assert episode.reward == 1.0  # kept on the episode, never trained: a failed episode is excluded
