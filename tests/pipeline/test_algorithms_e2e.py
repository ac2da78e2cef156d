"""The algorithm switches in a real pipeline run (local Ray, tiny random model): dynamic sampling drops
equal-reward groups and draws others, a distillation teacher served by an engine of its own scores the
samples, the trainer makes two optimizer steps per batch with a KL to its reference model, and the run
stops at its episode budget; what was dropped is recorded and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~2 min; fast: test_schedule_phases (dynamic sampling), engines/test_teacher_scoring, test_objective
def test_dynamic_sampling_distillation_and_several_updates(ray_local, tiny_model_dir, tmp_path):
    from actors.pipeline import Pipeline

    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(10)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(ROOT / "examples" / "calculator" / "config.yaml", [
        f"model.path={tiny_model_dir}", "exp_id=algo", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.e2e_support:IndexedAgent", "rollout.reward=tests.e2e_support:task_mixed_reward",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8", "rollout.max_turns=1",
        "rollout.episode_timeout_s=30", "trainer.steps=5", "trainer.num_steps_per_rollout=2",
        "trainer.micro_batch_tokens=2048", "sandbox_pool.min_warm=2", "logging.inspect_episodes_per_step=0",
        "pipeline.episode_budget=12",
        "algorithm.advantage_estimator=rloo", "algorithm.dynamic_sampling=true",
        "algorithm.kl_loss_coef=0.05", f"algorithm.distill_teacher={tiny_model_dir}", "algorithm.distill_coef=0.1",
    ])
    pipeline = Pipeline(cfg)
    try:
        assert pipeline.teacher_engine is not None and pipeline.teacher.url not in pipeline.engine_urls
        history = pipeline.run()
        # tasks t-0..t-3 give equal rewards: step 1 draws t-0, t-1 (dropped), t-2, t-3 (dropped), t-4, t-5
        first = history[0]
        assert first["pipeline/dynamic_dropped_groups"] == 4 and first["pipeline/dynamic_dropped_reward_1"] == 4
        assert first["rollout/episodes"] == 12  # the dropped groups' episodes count as drawn
        assert len(history) == 1  # 12 episodes: the budget is spent after one step
        assert first["train/optimizer_steps"] == 2 and first["train/trained_samples"] == 4
        assert "distill/reverse_kl" in first and abs(first["distill/reverse_kl"]) < 0.05  # the same weights
        assert first["train/ref_kl_mean"] >= 0.0
        rows = [json.loads(line) for line in (cfg.run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()]
        assert len(rows) == 12 and sum(r["advantage"] is None for r in rows) == 8  # dropped: recorded, not trained
    finally:
        pipeline.shutdown()
