"""A real training step writes the inspection data, and the inspector reads, serves and exports it.

Slow (a local Ray, the CPU engine, the trainer: about a minute on 2 cores), so it runs with
`make test-slow`; the default suite covers the same files written from scripted episodes through the
real gateway (tests/inspect/scripted_run.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayrl.config import load_config
from rayrl.inspect.atif import episode_trajectory
from rayrl.inspect.reader import RunReader
from tests.inspect.atif_check import check_trajectory

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_pipeline_step_writes_what_the_inspector_needs(ray_local, tiny_model_dir, tmp_path):
    from actors.pipeline import Pipeline

    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(ROOT / "examples" / "calculator" / "config.yaml", [
        f"model.path={tiny_model_dir}", "exp_id=inspect", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent",
        "rollout.reward=tests.pipeline.pipeline_support:index_reward", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_tokens=8", "rollout.episode_timeout_s=60", "trainer.steps=1",
        "trainer.micro_batch_tokens=2048", "sandbox_pool.min_warm=2", "logging.tensorboard=false",
        "logging.plot=false", "logging.inspect_episodes_per_step=3"])
    pipeline = Pipeline(cfg)
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    reader = RunReader(cfg.run_dir)
    run = reader.read()
    assert run.problems == [] and run.detail_steps == [1] and len(run.episodes) == 4
    assert [e["detail"] for e in run.episodes] == [True, True, True, False]
    assert {e["harness"] for e in run.episodes} == {"tests.pipeline.pipeline_support:SlowToolAgent"}
    advantages = [e["advantage"] for e in run.episodes]
    assert all(a is not None for a in advantages) and any(a > 0 for a in advantages)  # index_reward varies
    for e in run.episodes:
        detail = reader.episode(1, e["index"])
        tree = detail["tree"]
        assert tree["stats"]["turns"] == 2 and [n["role"] for n in tree["nodes"]][:2] == ["user", "assistant"]
        assert e["prompt"] == rows[int(e["task_id"].split("-")[1])]["prompt"]
        if e["detail"]:
            (sample,) = detail["samples"]  # two calls joined token for token (cumulative token mode)
            assert sample["turns"] == [0, 1] and sample["advantage"] == e["advantage"]
            mask = [v for v, n in sample["mask"] for _ in range(n)]
            assert 0 in mask and 1 in mask
            assert all(str(t) in detail["vocab"] for t in sample["tokens"])
        else:
            assert detail["samples"] is None
        check_trajectory(episode_trajectory(detail, str(tiny_model_dir)))
