"""``pipeline.eval_max_concurrent`` bounds validation's episodes in flight (actors/evaluation.py): never
more, and the bound is reached. Real Ray actors stand where the rollout workers stand."""

from __future__ import annotations

import ray

from actors.evaluation import evaluate
from rayrl.types import Task
from tests.agentcore.eval_support import Gate, GatedWorker


def test_validation_never_runs_more_than_eval_max_concurrent(ray_local):
    tasks = [Task(prompt=f"q{i}", metadata={}, task_id=f"t{i}") for i in range(7)]
    gate = Gate.remote(1, len(tasks))
    workers = [GatedWorker.options(max_concurrency=16).remote(gate) for _ in range(2)]  # one set for both bounds
    for bound in (1, 3):
        ray.get(gate.reset.remote(bound, len(tasks)))
        metrics = evaluate(workers, tasks, max_concurrent=bound, step=4)
        stats = ray.get(gate.stats.remote())
        assert stats["entered"] == len(tasks) and stats["in_flight"] == 0
        assert stats["peak"] == bound, stats  # held at the gate until the bound was reached; never beyond it
        assert metrics["eval/episodes_failed"] == 0 and metrics["eval/reward_mean"] == 1.0
