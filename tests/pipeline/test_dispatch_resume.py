"""A resume while groups are in flight must not run (and record) any group twice.

The interleaving that made tests/multinode/test_multinode.py::test_colocated_layout_spread_over_three_nodes
flaky under load: a checkpoint is saved and resumed on a live pipeline while one group is complete but not
yet taken and another is still running. The checkpoint lists both as untrained; queueing them again next
to the same groups still in flight made the complete group come back a second time, and one step took
both copies (8 episodes, 4 distinct (group_id, index)). Here real rollout-worker actors are held on a
gate, so that moment is reached every time, not when the machine happens to be slow.
"""

from __future__ import annotations

import time

import pytest
import ray

from actors.dispatch import GroupDispatcher
from rayrl.types import Episode, Task


@ray.remote
class Gate:
    """Episodes of a group block until the test opens that group's gate."""

    def __init__(self) -> None:
        self.opened: set[str] = set()

    def open(self, group_id: str) -> None:
        self.opened.add(group_id)

    def is_open(self, group_id: str) -> bool:
        return group_id in self.opened


@ray.remote(max_concurrency=16)
class GatedWorker:
    """A rollout worker whose episodes end when their group's gate opens (the real actor interface)."""

    def __init__(self, gate) -> None:
        self.gate = gate
        self.started: list[tuple[str, int]] = []

    def run_episode(self, task: Task, group_id: str, index: int) -> Episode:
        self.started.append((group_id, index))
        while not ray.get(self.gate.is_open.remote(group_id)):
            time.sleep(0.05)
        return Episode(session_id=f"{group_id}-{index}-{len(self.started)}", task_id=task.task_id, group_id=group_id,
                       reward=float(index % 2))

    def starts(self) -> list[tuple[str, int]]:
        return list(self.started)


def _poll_until(dispatcher: GroupDispatcher, predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, (dispatcher.active, dispatcher.completed)
        dispatcher.poll(0.1)


def _task(i: int) -> Task:
    return Task(prompt=f"What is {i} + 1?", metadata={"answer": i + 1}, task_id=f"t-{i}")


def test_resume_with_groups_in_flight_runs_each_group_once(ray_local):
    gate = Gate.remote()
    worker = GatedWorker.remote(gate)
    dispatcher = GroupDispatcher([worker], group_size=2, limit=2, restart_worker=lambda k: worker)
    dispatcher.submit(_task(1), "g000001-t-1")
    dispatcher.submit(_task(2), "g000002-t-2")
    ray.get(gate.open.remote("g000001-t-1"))
    _poll_until(dispatcher, lambda: len(dispatcher.completed) == 1)
    assert list(dispatcher.active) == ["g000002-t-2"]  # the moment: one group complete, one running

    rows = dispatcher.untrained_tasks()  # what a checkpoint saved now holds
    assert [r["group_id"] for r in rows] == ["g000001-t-1", "g000002-t-2"]
    with pytest.raises(ValueError, match="already in flight"):  # queueing them beside themselves
        dispatcher.submit(GroupDispatcher.task_of(rows[0]), rows[0]["group_id"])
    dispatcher.restore(rows)  # what RunCheckpoints.resume does

    ray.get(gate.open.remote("g000002-t-2"))
    _poll_until(dispatcher, lambda: len(dispatcher.completed) == 2)
    taken = dispatcher.take(4)
    for _ in range(10):  # nothing else comes back: the episodes dropped at the resume stay dropped
        dispatcher.poll(0.1)
    taken += dispatcher.take(4)
    # each group once (which of the two re-run groups completes first is the worker's scheduling)
    assert sorted(g.group_id for g in taken) == ["g000001-t-1", "g000002-t-2"]
    episodes = [(e.group_id, e.info["index"]) for g in taken for e in g.ordered()]
    assert sorted(episodes) == [("g000001-t-1", 0), ("g000001-t-1", 1), ("g000002-t-2", 0), ("g000002-t-2", 1)]
    assert dispatcher.groups_in_flight == 0 and not dispatcher.running
