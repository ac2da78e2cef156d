"""LocalAgentCore: the agent app, the FAKE runtime and moto S3 as local processes, started and stopped."""

from __future__ import annotations

import sys
import uuid

import pytest
from _agentcore_kit import ROOT

from rayrl.agents.agentcore.launcher import RolloutLauncher
from rayrl.agents.agentcore.local import LocalAgentCore
from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, result_key
from rayrl.config import AgentCoreConfig


@pytest.mark.parametrize("region", ["us-west-2", "us-east-1"])  # us-east-1: S3's default, named differently
def test_local_stack_runs_a_session_and_stops_its_processes(tmp_path, region):
    cfg = AgentCoreConfig(local_agent_command=["python", str(ROOT / "tests" / "agentcore" / "scripted_agent.py")],
                          poll_interval_s=0.1, region=region)
    local = LocalAgentCore(cfg, tmp_path / "logs")
    with local:
        settings, credentials = local.start()
        assert settings.endpoint_url.startswith("http://127.0.0.1:") and settings.s3_endpoint_url
        assert settings.runtime_arn.startswith("arn:aws:bedrock-agentcore:") and settings.s3_bucket
        launcher = RolloutLauncher(settings, credentials=credentials)
        sid = f"s0-{uuid.uuid4().hex}"
        key = result_key(settings.s3_prefix, "exp", "t", sid)
        rollout = AgentRolloutConfig(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", exp_id="exp",
                                     session_id=sid, s3_bucket=settings.s3_bucket, result_key=key)
        outcome = launcher.run_session({"answer": 11, ROLLOUT_CONFIG_KEY: rollout.to_dict()}, sid,
                                       settings.s3_bucket, key)
        assert outcome.ok and outcome.result["final_answer"] == "11"
        procs = dict(local.procs)
        assert set(procs) == {"moto", "agent", "emulator"} and all(p.poll() is None for p in procs.values())
    assert all(p.poll() is not None for p in procs.values())  # stop() ended every child it started
    assert (tmp_path / "logs" / "agentcore-agent.log").exists()


def test_an_agent_that_cannot_start_is_a_clear_error_and_nothing_is_left_running(tmp_path):
    cfg = AgentCoreConfig(local_agent_command=[sys.executable, "-c", "raise SystemExit(3)"])
    local = LocalAgentCore(cfg, tmp_path / "logs")
    with pytest.raises(RuntimeError, match="agent app exited with code 3"):
        local.start()
    assert local.procs == {}  # moto, already started, was stopped again
