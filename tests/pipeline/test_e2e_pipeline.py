"""Two pipeline steps end to end in a real local Ray, on the tiny random model.

Every component is real: the CPU engine subprocess behind the router, the gateway in the trajectory
manager, sandboxes from the pool, rollout workers running the openai-SDK agent, the trainer in its
placement group, and the weight sync back to the engine. The slow twin goes on: a second pipeline resumes
from the checkpoint and runs a third step.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from rayrl.config import load_config
from rayrl.startup import read_starts
from tests.ray_support import scrape_metrics

ROOT = Path(__file__).resolve().parents[2]


def two_steps(metrics_port: int, model_dir: Path, tmp_path: Path) -> tuple[Path, list[str], int]:
    """Two steps of the calculator config with failures on purpose, every outcome checked; returns the run
    directory, the task ids trained, and the policy version reached."""
    from actors.pipeline import Pipeline

    data = tmp_path / "tasks.jsonl"
    rows = [{"id": "t-first", "prompt": "What is 2 + 3?", "metadata": {"question": "What is 2 + 3?", "answer": 5}}]
    rows += [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
              "answer": i + 1}} for i in range(7)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(
        ROOT / "examples" / "calculator" / "config.yaml",
        [
            f"model.path={model_dir}",
            "exp_id=e2e",
            f"logging.output_dir={tmp_path / 'runs'}",
            f"data.train_path={data}",
            "data.shuffle=false",
            "engine.dtype=float32",
            "rollout.agent=tests.e2e_support:FlakyAgent",
            "rollout.reward=tests.e2e_support:parity_reward",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens=12",
            "rollout.max_turns=2",
            "rollout.episode_timeout_s=10",
            "rollout.min_group_episodes=1",  # t-first's group trains on its one success instead of running again
            "trainer.steps=2",
            "trainer.micro_batch_tokens=2048",
            "sandbox_pool.min_warm=2",
        ],
    )
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2
        step1 = history[0]
        # task "t-first" is in step 1: a crashed, a looping and a sandbox-killed episode, all failed and counted
        assert step1["rollout/episodes_failed"] == 3 and step1["rollout/episodes_ok"] == 5
        episodes = [json.loads(line)
                    for line in (cfg.run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()]
        errors = sorted(e["error"] or "" for e in episodes if e["status"] == "failed")
        assert any(e.startswith("agent_crashed: RuntimeError: agent bug on purpose") for e in errors)
        assert any(e.startswith("timed_out: episode timed out") for e in errors)
        assert any(e.startswith("sandbox_failed: SandboxError") for e in errors)  # only its own episode
        assert step1["failures/agent_crashed"] == step1["failures/timed_out"] == step1["failures/sandbox_failed"] == 1
        assert history[1]["rollout/episodes_failed"] == 0
        trained = [h for h in history if h.get("train/trained_samples", 0) > 0]
        assert pipeline.version == len(trained)
        if trained:  # the engine serves the trainer's newest weights
            for url in pipeline.engine_urls:
                with urllib.request.urlopen(f"{url}/get_weight_version", timeout=10) as resp:
                    assert json.load(resp)["weight_version"] == str(pipeline.version)
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]
        assert (cfg.run_dir / "reward_curve.png").stat().st_size > 1000
        assert any((cfg.run_dir / "tensorboard").iterdir())
        stats = pipeline.gateway.stats()
        assert sum(s["requests"] for s in stats) >= 12 and all(s["open_sessions"] == 0 for s in stats)
        assert history[1]["gateway/requests"] == sum(s["requests"] for s in stats)
        # a group's episodes share their prompt, and turn 2 starts with turn 1: the engine reuses that KV
        assert history[1]["engine/prompt_tokens"] > 0 and 0 < history[1]["engine/prefix_cache_hit_rate"] < 1
        assert history[1]["engine/decode_s"] > 0 and 0 < history[1]["engine/busy_fraction"] <= 1
        # the start, as startup.json records it: every part began before any of them was ready (they start
        # together), then the joins, the first rollout and the first step, in that order
        (start,) = read_starts(cfg.run_dir)
        phases, began = start["phases"], {k: v["began"] for k, v in start["details"].items() if "began" in v}
        parts = ["engines_ready", "trainer_ready", "gateway_ready", "sandboxes_warm", "workers_ready"]
        assert set(began) == set(parts), start
        assert max(began.values()) < min(phases[p] for p in parts), start
        assert max(phases[p] for p in parts) <= phases["all_actors_ready"] <= phases["first_rollout_done"] \
            <= phases["first_step_trained"], start
        checkpoint = pipeline.checkpoints.latest()
        assert checkpoint is not None and Path(checkpoint).name == "step000002"
        seen = [e["task_id"] for step in (1, 2)
                for e in map(json.loads, (cfg.run_dir / "episodes" / f"step{step:06d}.jsonl").read_text().splitlines())]
        version = pipeline.version
        # step metrics and sandbox-pool metrics reach the node's Prometheus endpoint
        names = ["ray_rayrl_step_metric", 'metric="rollout/reward_mean"', "ray_rayrl_sandbox_acquire_latency_s_bucket"]
        text = scrape_metrics(metrics_port, names)
        assert all(n in text for n in names), [n for n in names if n not in text]
    finally:
        pipeline.shutdown()
    return cfg.run_dir, seen, version


def test_two_steps_end_to_end(ray_local, tiny_model_dir, tmp_path):
    two_steps(ray_local, tiny_model_dir, tmp_path)


@pytest.mark.slow  # ~60 s on top of the two steps; fast: tests/ops/test_checkpoint_store.py, schedule-phase resumes
def test_two_steps_then_a_resume_runs_the_third_on_unseen_tasks(ray_local, tiny_model_dir, tmp_path):
    from actors.pipeline import Pipeline

    run_dir, seen, version = two_steps(ray_local, tiny_model_dir, tmp_path)
    # resume: a new pipeline continues at step 3 with the restored weights and the next, unseen tasks
    resumed = Pipeline(load_config(run_dir / "config.yaml", ["trainer.steps=3"]), resume=True)  # as driver.py
    try:
        assert resumed.resume()
        assert resumed.step == 2 and resumed.version == version
        loaded = json.loads((run_dir / "startup.json").read_text())["starts"][-1]["details"]["checkpoint_loaded"]
        assert loaded["preload_s"] > 0 and loaded["trainer_load_s"] < loaded["preload_s"]  # loaded as it started
        for url in resumed.engine_urls:
            with urllib.request.urlopen(f"{url}/get_weight_version", timeout=10) as resp:
                assert json.load(resp)["weight_version"] == str(version if version else 0)
        resumed.run()
        step3 = [json.loads(line)["task_id"]
                 for line in (run_dir / "episodes" / "step000003.jsonl").read_text().splitlines()]
        assert len(set(step3)) == 2 and not set(step3) & set(seen)  # 8 tasks: no task trained twice in the epoch
    finally:
        resumed.shutdown()
