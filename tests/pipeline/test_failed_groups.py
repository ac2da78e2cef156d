"""Only infrastructure failures make a task run again; every failed episode of every attempt is recorded once.

A real local Ray, the real pipeline (sync schedule) on the tiny model, with a plain function agent
(tests/byo_agents.py ``fails_by_task``) that fails on purpose: task "t-bug" by its own bug every time
(a KeyError after its LLM call), task "t-infra" because its tool service is down every time
(InfrastructureError). The bug counts against its task and trains, once; the infrastructure failure
makes its group run again, twice (``pipeline.max_group_reruns``), and all three attempts' episodes are in
``episodes/step000001.jsonl`` and in ``failures/service_failed``, with the cause on the rerun line.
"""

from __future__ import annotations

import json
import logging

import pytest

from rayrl.config import load_config
from tests.pipeline.run_config import ROOT


# ~45 s, a whole pipeline; fast: tests/rl/test_rl_groups.py (scoring vs rerun per failure kind) and
# test_schedule_phases.py::test_the_agents_own_failures_are_scored_never_run_again
@pytest.mark.slow
def test_agent_bugs_score_infrastructure_failures_rerun_and_every_attempt_is_written(ray_local, tiny_model_dir,
                                                                                    tmp_path, caplog):
    from actors.pipeline import Pipeline

    data = tmp_path / "tasks.jsonl"
    rows = [{"id": "t-bug", "prompt": "Convert 3 feet to cm.", "metadata": {"answer": 91.44}},
            {"id": "t-infra", "prompt": "Convert 2 miles to km.", "metadata": {"answer": 3.219}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(ROOT / "examples" / "unit_convert" / "config.yaml", [
        "exp_id=failed-groups", f"model.path={tiny_model_dir}", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.byo_agents:fails_by_task", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=8", "rollout.min_group_episodes=2", "pipeline.max_group_reruns=2", "trainer.steps=1",
        "pipeline.checkpoint_interval=-1", "logging.tensorboard=false", "logging.plot=false",
    ])
    caplog.set_level(logging.WARNING, logger="rayrl")
    pipeline = Pipeline(cfg)
    try:
        [metrics] = pipeline.run()
    finally:
        pipeline.shutdown()
    episodes = [json.loads(line) for line in (cfg.run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()]
    bug = [e for e in episodes if e["task_id"] == "t-bug"]
    infra = [e for e in episodes if e["task_id"] == "t-infra"]
    # the bug: one attempt, scored (0 from the example's reward) and not set aside
    assert len(bug) == 2 and all(e["failure"] == "agent_crashed" and e["reward"] == 0.0 for e in bug)
    assert all("KeyError: 'unit_label'" in e["error"] and "byo_agents.py:" in e["error"] for e in bug)
    assert all(e["advantage"] == 0.0 and "discarded" not in e for e in bug)  # in the batch (flat group)
    # the infrastructure failure: three attempts, six episodes, the first two groups set aside as reruns
    assert len(infra) == 6 and all(e["failure"] == "service_failed" for e in infra)
    assert sum(e.get("discarded") == "rerun" for e in infra) == 4 and len({e["group_id"] for e in infra}) == 3
    assert all(e["advantage"] is None for e in infra)  # never trained
    assert metrics["failures/agent_crashed"] == 2 and metrics["failures/service_failed"] == 6  # each once
    assert metrics["pipeline/rerun_short_groups"] == 2 and metrics["pipeline/short_groups_kept"] == 1
    assert metrics["rollout/episodes"] == 4 and metrics["rollout/episodes_set_aside"] == 4
    assert metrics["rollout/episodes_failed"] == 4 and metrics["rollout/episodes_excluded"] == 2
    reruns = [r.getMessage() for r in caplog.records if "running the task again" in r.getMessage()]
    assert len(reruns) == 2 and all("(task t-infra): infrastructure failed 2 of 2 episodes (service_failed x2)" in m
                                    for m in reruns)
    assert not any("t-bug" in m for m in reruns)
