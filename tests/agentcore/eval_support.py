"""Ray actors for the validation-bound test (importable by Ray workers as ``tests.agentcore.eval_support``).

``Gate`` counts the validation episodes in flight. Each episode enters it and is held there until as many
episodes as the bound are in at once (or every task has entered), so the bound is reached by
construction, not by timing, and any episode started beyond it is seen in ``peak``.
"""

from __future__ import annotations

import asyncio

import ray

from rayrl.types import Episode, Task


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self, bound: int, total: int) -> None:
        self.reset(bound, total)

    def reset(self, bound: int, total: int) -> None:
        """Count afresh for another validation run (the same actors serve each bound)."""
        self.bound, self.total = bound, total
        self.in_flight = self.peak = self.entered = 0

    async def enter(self) -> None:
        self.in_flight += 1
        self.entered += 1
        self.peak = max(self.peak, self.in_flight)
        while self.in_flight < self.bound and self.entered < self.total:
            await asyncio.sleep(0.01)

    async def leave(self) -> None:
        self.in_flight -= 1

    async def stats(self) -> dict[str, int]:
        return {"peak": self.peak, "entered": self.entered, "in_flight": self.in_flight}


@ray.remote(num_cpus=0)
class GatedWorker:
    """Stands where a RolloutWorker stands in ``evaluate``: ``run_episode(task, group_id, index)``."""

    def __init__(self, gate: object) -> None:
        self.gate = gate

    def run_episode(self, task: Task, group_id: str, index: int = 0) -> Episode:
        ray.get(self.gate.enter.remote())
        ray.get(self.gate.leave.remote())
        return Episode(session_id=f"s-{group_id}", task_id=task.task_id, group_id=group_id, reward=1.0)
