"""The data contract on the AgentCore path (seed 001's three invariants), the harness, rewards, config.

1. a JSONL row's ``metadata`` is the agent payload verbatim (top-level ``prompt``/``label`` never leak in);
2. the payload handed out is a shallow copy: the agent (or the harness adding ``rollout_config``)
   mutating it never changes the dataset;
3. missing / None / non-dict metadata gives an empty payload.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from _agentcore_kit import BUCKET, CREDS, REGION, ROOT

from rayrl.agents import make_harness
from rayrl.agents.agentcore.emulator import DEFAULT_LOCAL_ARN, FakeAgentCoreRuntime
from rayrl.agents.agentcore.harness import AgentCoreHarness, public_base_url
from rayrl.agents.agentcore.launcher import RolloutLauncher
from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, AgentRolloutConfigError
from rayrl.agents.base import AgentResult, EpisodeContext
from rayrl.config import AgentCoreConfig, ConfigError, load_config
from rayrl.data.dataset import DatasetError, FileDataset
from rayrl.resolve import load_checked
from rayrl.rewards import get_reward_fn
from rayrl.rewards.gsm8k import agent_reported_reward, gsm8k_reward, parse_gsm8k_answer
from rayrl.types import Task


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ctx(session_id: str | None = None, timeout_s: float = 60.0) -> EpisodeContext:
    return EpisodeContext(base_url="http://127.0.0.1:4000/v1", api_key="rrl-secret", model="policy",
                          temperature=0.7, top_p=0.9, max_tokens=64, max_turns=3,
                          deadline=time.monotonic() + timeout_s, session_id=session_id or f"s0-{uuid.uuid4().hex}")


def harness(launcher=None, **cfg) -> AgentCoreHarness:
    settings = AgentCoreConfig(runtime_arn=DEFAULT_LOCAL_ARN, s3_bucket=BUCKET, **cfg)
    return make_harness("agentcore", launcher=launcher, cfg=settings, exp_id="exp-1")


def test_invariant_1_metadata_is_the_payload_verbatim(tmp_path):
    meta = {"prompt": "How many?", "answer": "7", "tools": ["calc"], "nested": {"k": [1, 2]}}
    ds = FileDataset(write_rows(tmp_path / "d.jsonl", [{"prompt": "TOP-LEVEL", "label": "L", "metadata": meta}]))
    payload, rollout = harness().payload_for(ds[0], ctx())
    agent_part = {k: v for k, v in payload.items() if k != ROLLOUT_CONFIG_KEY}
    assert agent_part == meta  # exactly the metadata: neither prompt nor label is mixed in
    assert payload[ROLLOUT_CONFIG_KEY] == rollout.to_dict()


def test_invariant_2_payload_is_a_shallow_copy(tmp_path):
    meta = {"prompt": "q", "answer": "3", "nested": {"k": [1]}}
    ds = FileDataset(write_rows(tmp_path / "d.jsonl", [{"prompt": "q", "metadata": meta}]))
    task = ds[0]
    payload, _ = harness().payload_for(task, ctx())
    assert ROLLOUT_CONFIG_KEY not in task.metadata  # adding rollout_config touched only the copy
    payload["answer"] = "999"
    payload.pop("prompt")
    payload["extra"] = True
    assert task.metadata == meta and ds[0].metadata == meta
    assert payload["nested"] is task.metadata["nested"]  # shallow: nested values are shared, not copied
    again, _ = harness().payload_for(task, ctx())
    assert {k: v for k, v in again.items() if k != ROLLOUT_CONFIG_KEY} == meta


@pytest.mark.parametrize("metadata", ["missing", None, "a string", [1, 2], 5])
def test_invariant_3_missing_or_non_dict_metadata_is_an_empty_payload(tmp_path, metadata):
    """Missing or null metadata is an empty payload, as in agentcore-rl-toolkit. A data file whose row has a
    metadata that is not an object is refused at load with its file:line (issue 27: data rows are checked
    before Ray starts) where the toolkit would send an empty payload; a Task built by hand keeps the rule."""
    row = {"prompt": "p"} if metadata == "missing" else {"prompt": "p", "metadata": metadata}
    path = write_rows(tmp_path / "d.jsonl", [row])
    if metadata in ("missing", None):
        payload, _ = harness().payload_for(FileDataset(path)[0], ctx())
        assert list(payload) == [ROLLOUT_CONFIG_KEY]
    else:
        with pytest.raises(DatasetError, match=r"d\.jsonl:1: 'metadata' must be an object"):
            FileDataset(path)
    assert Task(prompt="p", metadata=metadata).payload() == {}  # even when built by hand


def test_prompt_drives_length_filtering_only(tmp_path):
    rows = [{"prompt": "x" * 50, "metadata": {"prompt": "short"}}, {"prompt": "ok", "metadata": {"prompt": "y" * 500}}]
    ds = FileDataset(write_rows(tmp_path / "d.jsonl", rows), max_prompt_chars=10)
    assert len(ds) == 1 and ds.filtered == 1 and ds[0].metadata == {"prompt": "y" * 500}


def test_rollout_config_carries_gateway_session_and_result_location():
    c = ctx(session_id="s3-" + "a" * 32)
    payload, rollout = harness(gateway_public_host="gw.example.com", s3_prefix="runs").payload_for(
        Task(prompt="p", metadata={"a": 1}, task_id="task/7"), c)
    cfg = AgentRolloutConfig.from_payload(payload)
    assert cfg.base_url == "http://gw.example.com:4000/v1" and cfg.api_key == "rrl-secret" and cfg.model == "policy"
    assert cfg.session_id == c.session_id and cfg.exp_id == "exp-1" and cfg.s3_bucket == BUCKET
    assert cfg.result_key == f"runs/exp-1/task_7/{c.session_id}.json"
    assert cfg.sampling == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64} and cfg.max_turns == 3
    assert 0 < cfg.timeout_s < 60
    assert public_base_url("http://127.0.0.1:80/v1", None) == "http://127.0.0.1:80/v1"
    with pytest.raises(AgentRolloutConfigError, match="result_key"):
        AgentRolloutConfig.from_payload({ROLLOUT_CONFIG_KEY: {**cfg.to_dict(), "result_key": ""}})
    with pytest.raises(AgentRolloutConfigError, match="missing"):
        AgentRolloutConfig.from_payload({"prompt": "no rollout config"})


def test_harness_runs_a_session_and_the_agent_sees_only_its_metadata(loop_thread, agent_app, moto_s3, tmp_path):
    fake = FakeAgentCoreRuntime(agent_app, DEFAULT_LOCAL_ARN)
    loop_thread.run(fake.start())
    try:
        settings = AgentCoreConfig(runtime_arn=DEFAULT_LOCAL_ARN, region=REGION, endpoint_url=fake.url,
                                   s3_bucket=BUCKET, s3_endpoint_url=moto_s3, poll_interval_s=0.1)
        launcher = RolloutLauncher(settings, credentials=CREDS)
        h = make_harness("agentcore", launcher=launcher, cfg=settings, exp_id="exp-1")
        meta = {"behaviour": "echo", "prompt": "What is 6 * 7?", "answer": "42"}
        ds = FileDataset(write_rows(tmp_path / "d.jsonl", [{"prompt": "What is 6 * 7?", "metadata": meta},
                                                             {"prompt": "m", "metadata": {"behaviour": "mutate",
                                                                                          "answer": "1"}}]))
        result = h.run(ds[0], ctx())
        assert result.status == "completed" and result.final_answer == "42"
        assert result.info["payload_seen"] == meta  # what the agent received, as it received it
        assert result.info["agentcore"]["status"] == "completed" and result.info["agentcore"]["attempts"] == 1
        assert gsm8k_reward(ds[0], result) == 1.0
        mutated = h.run(ds[1], ctx())  # the agent clears its payload; the dataset keeps its row
        assert mutated.final_answer == "mutated" and ds[1].metadata == {"behaviour": "mutate", "answer": "1"}
        crashed = h.run(Task(prompt="p", metadata={"behaviour": "crash"}, task_id="t"), ctx())
        assert crashed.status == "error" and "scripted crash" in crashed.error
        assert gsm8k_reward(Task(prompt="p", metadata={"answer": 1}), crashed) == 0.0
    finally:
        loop_thread.run(fake.stop())


def test_gsm8k_reward_and_agent_reported_reward():
    task = Task(prompt="q", metadata={"answer": "Natalia sold 48/2 = 24 clips in May.\n#### 72"})
    done = lambda text: AgentResult(final_answer=text, status="completed")  # noqa: E731
    assert parse_gsm8k_answer("so 70 + 2\n#### 72") == 72.0
    assert parse_gsm8k_answer("The answer is \\boxed{1,234}.") == 1234.0
    assert parse_gsm8k_answer("I think it is 5, no 72") == 72.0
    assert parse_gsm8k_answer("no number") is None
    assert gsm8k_reward(task, done("#### 72")) == 1.0
    assert gsm8k_reward(task, done("#### 72 ... wait, #### 71")) == 0.0  # the last committed answer counts
    assert gsm8k_reward(task, AgentResult(final_answer="#### 72", status="error")) == 0.0
    assert gsm8k_reward(Task(prompt="q", metadata={"answer": 3}), done("3.0")) == 1.0
    assert gsm8k_reward(Task(prompt="q", metadata={}), done("3")) == 0.0
    reported = lambda r: AgentResult(final_answer="x", status="completed", info={"rewards": r})  # noqa: E731
    assert agent_reported_reward(task, reported([0.0, 0.5, 1.0])) == 1.0
    assert agent_reported_reward(task, reported(0.25)) == 0.25
    assert agent_reported_reward(task, reported(float("nan"))) == 0.0
    assert agent_reported_reward(task, reported([])) == 0.0
    assert agent_reported_reward(task, AgentResult(status="completed")) == 0.0
    assert get_reward_fn("gsm8k") is gsm8k_reward and get_reward_fn("agent_reported") is agent_reported_reward


def test_config_section_is_validated(tmp_path):
    base = ["rollout.agent=agentcore"]
    with pytest.raises(ConfigError, match="agentcore.runtime_arn"):
        load_checked(None, base)
    with pytest.raises(ConfigError, match="agentcore.s3_bucket"):
        load_checked(None, [*base, "agentcore.runtime_arn=arn:aws:bedrock-agentcore:us-west-2:1:runtime/x"])
    ok = load_checked(None, [*base, "agentcore.runtime_arn=arn:aws:bedrock-agentcore:us-west-2:1:runtime/x",
                            "agentcore.s3_bucket=b"])
    assert ok.agentcore.s3_bucket == "b"
    for bad in ("agentcore.acr_tps_limit=0", "agentcore.max_concurrent=0", "agentcore.max_retries=-1",
                "agentcore.session_timeout_s=-5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="agentcore.nope"):
        load_config(None, ["agentcore.nope=1"])
    local = load_config(ROOT / "examples" / "agentcore" / "config.yaml")  # local mode: no ARN, no bucket
    assert local.rollout.agent == "agentcore" and local.agentcore.local_agent_command
