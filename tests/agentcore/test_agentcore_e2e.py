"""The whole AgentCore flow in local mode: two training steps of the GSM8K-style math agent.

Real everything except AWS: a local Ray; the CPU engine with the tiny random model; the gateway in the
gateway shard; the rollout workers with the ``agentcore`` harness; the run's launcher actor
invoking ``examples/agentcore/math_agent.py`` (the bedrock-agentcore SDK app) through boto3 and the
FAKE AgentCore Runtime; results through a moto S3 server; GRPO steps and the weight sync.

The tiny random model never solves a problem, so the reward here is tests.e2e_support:parity_reward
(it varies, so GRPO has a gradient); the gsm8k reward is tested on real answers in
test_agentcore_contract.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from rayrl.config import load_config

pytest.importorskip("moto")
pytest.importorskip("bedrock_agentcore")

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


@pytest.mark.slow  # ~90 s; fast: agentcore/test_agentcore_eval_bound runs the local AgentCore path on Ray
def test_two_training_steps_through_local_agentcore(ray_local, tiny_model_dir, tmp_path):
    from actors.pipeline import Pipeline

    agent = ROOT / "examples" / "agentcore" / "math_agent.py"
    cfg = load_config(
        ROOT / "examples" / "agentcore" / "config.yaml",
        [
            f"model.path={tiny_model_dir}",
            "exp_id=agentcore-e2e",
            f"logging.output_dir={tmp_path / 'runs'}",
            "logging.tensorboard=false",
            f"data.train_path={ROOT / 'examples' / 'agentcore' / 'data' / 'train.jsonl'}",
            f"data.val_path={ROOT / 'examples' / 'agentcore' / 'data' / 'val.jsonl'}",
            "data.shuffle=false",
            "engine.dtype=float32",
            f"agentcore.local_agent_command=[python,{agent}]",
            "agentcore.max_concurrent=6",
            "agentcore.acr_tps_limit=20",
            "agentcore.poll_interval_s=0.2",
            "agentcore.session_timeout_s=50",
            "rollout.reward=tests.e2e_support:parity_reward",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens=12",
            "rollout.max_turns=2",
            "rollout.episode_timeout_s=60",
            "trainer.steps=2",
            "trainer.micro_batch_tokens=2048",
            "pipeline.eval_interval=2",
            "pipeline.eval_tasks=3",
            "pipeline.eval_max_concurrent=2",
        ],
    )
    pipeline = Pipeline(cfg)
    pids: dict[str, int] = {}
    try:
        history = pipeline.run()
        assert len(history) == 2
        assert [h["rollout/episodes_ok"] for h in history] == [8, 8], history
        assert all(h["rollout/episodes_failed"] == 0 for h in history)
        episodes = [json.loads(line) for step in (1, 2)
                    for line in (cfg.run_dir / "episodes" / f"step{step:06d}.jsonl").read_text().splitlines()]
        assert {e["agent_status"] for e in episodes} == {"completed"}
        # multi-turn: the agent's follow-up extends its first turn, so the two turns merge into one sample
        assert all(1 <= e["samples"] <= e["turns"] for e in episodes)
        assert any(e["turns"] == 2 and e["samples"] == 1 for e in episodes)
        assert history[-1]["gateway/cumulative_hits"] > 0

        trained = [h for h in history if h.get("train/trained_samples", 0) > 0]
        assert pipeline.version == len(trained)

        # validation ran before step 1 and after step 2, on its own concurrency bound
        evals = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
                 if "eval/reward_mean" in line]
        assert [e["step"] for e in evals] == [0, 2] and all(e["eval/episodes_failed"] == 0 for e in evals)

        # one result object per session in (moto) S3; the launcher saw every session complete, unthrottled
        launcher = ray.get_actor(f"rayrl-{cfg.exp_id}-agentcore-launcher")
        settings = ray.get(launcher.settings.remote())
        stats = ray.get(launcher.stats.remote())
        sessions = 2 * 8 + 2 * 3
        assert stats["sessions_completed"] == sessions and stats["invoke_requests"] == sessions
        assert stats["peak_in_flight"] <= 6
        import boto3

        from rayrl.agents.agentcore.local import LOCAL_CREDENTIALS

        s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.region,
                          **LOCAL_CREDENTIALS)
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=settings.s3_bucket, Prefix=f"{settings.s3_prefix}/{cfg.exp_id}/") for o in page.get("Contents", [])]
        assert len(keys) == sessions
        assert {Path(k).stem for k in keys} >= {e["session_id"] for e in episodes}  # runtimeSessionId = gateway session
        pids = ray.get(launcher.__ray_call__.remote(lambda actor: {name: proc.pid
                                                                   for name, proc in actor.local.procs.items()}))
        assert set(pids) == {"moto", "agent", "emulator"}
    finally:
        pipeline.shutdown()
    # the local stack dies with the launcher actor (its owner, a rollout worker, was killed)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [name for name, p in pids.items() if _alive(p)]
