"""GroupsInFlight: the groups a dispatcher holds (queued, running, complete and not yet taken), without Ray.

What the schedules and the checkpoints rely on of a dispatcher, apart from running episodes: a group id
is in flight at most once (:meth:`GroupsInFlight.submit` refuses one already queued, running or
complete; adding a checkpoint's groups next to the same groups still in flight is how one group came to
be trained twice in one step), completed groups are taken oldest first, and a checkpoint's untrained
groups replace whatever is in flight (:meth:`GroupsInFlight.restore`). actors/dispatch.py's
GroupDispatcher runs the episodes on the rollout workers on top of it; tests/orchestration/test_schedule_phases.py's
fake dispatcher completes them in-process on top of the same bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from rayrl.rl.groups import Group
from rayrl.types import Task


class GroupsInFlight:
    """Queued, running (``active``) and completed groups of ``group_size`` episodes each."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.queue: deque[Group] = deque()  # waiting to start
        self.active: dict[str, Group] = {}  # started, not complete
        self.completed: deque[Group] = deque()  # complete, not yet taken

    def submit(self, task: Task, group_id: str, front: bool = False, reruns: int = 0) -> None:
        """Queue a group of ``task`` (``front``: before the others; ``reruns``: how often it ran before).
        Raises ValueError for a group id already in flight: its episodes would be recorded twice."""
        if group_id in self.active or any(g.group_id == group_id for g in (*self.queue, *self.completed)):
            raise ValueError(f"group {group_id} is already in flight")
        group = Group(task, group_id, self.group_size, reruns=reruns)
        (self.queue.appendleft if front else self.queue.append)(group)

    @property
    def groups_in_flight(self) -> int:
        """Groups queued, running or complete but not taken."""
        return len(self.queue) + len(self.active) + len(self.completed)

    def take(self, n: int) -> list[Group]:
        """Up to ``n`` completed groups, oldest first."""
        out = []
        while self.completed and len(out) < n:
            out.append(self.completed.popleft())
        return out

    def drop(self) -> None:
        """Forget every group in flight (a dispatcher also stops what it runs for them)."""
        self.queue.clear()
        self.active.clear()
        self.completed.clear()

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Make a checkpoint's untrained groups (``rows``, oldest first, as :meth:`untrained_tasks` wrote
        them) the whole of the work: what is in flight now is dropped first (its episodes' results are
        ignored), so a group that is both in flight and in the checkpoint runs once."""
        self.drop()
        for row in rows:
            self.submit(self.task_of(row), row["group_id"])

    def untrained_tasks(self) -> list[dict[str, Any]]:
        """Every group not yet handed to the trainer, oldest first, as JSON-safe rows."""
        groups = list(self.completed) + list(self.active.values()) + list(self.queue)
        return [{"task": dataclasses.asdict(g.task), "group_id": g.group_id} for g in groups]

    @staticmethod
    def task_of(row: dict[str, Any]) -> Task:
        return Task(**row["task"])
