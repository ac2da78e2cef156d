"""GroupDispatcher: keeps task groups running on the rollout workers and collects completed groups.

A group is ``rollout.group_size`` episodes of one task (one GRPO group: ``Group`` in rayrl/rl/groups.py).
The dispatcher starts groups from a queue, at most ``limit`` at once, spreading episodes over the
workers; a group is complete when every one of its episodes has come back (ok or failed). The
pipeline decides what to queue and when to take completed groups; this class only keeps the work
moving and accounts for it.

Fault tolerance: when a rollout worker actor dies, every episode it was running is re-queued (same
group, same index: not lost, not counted twice) and a fresh worker takes its place; the death is
counted and logged once. An episode re-queued more than ``max_retries`` times fails instead.

Which groups are queued, running and complete, and the rules on them (a group id in flight at most once,
oldest first, a checkpoint's groups replacing what is in flight), are rayrl/orchestration/groups_in_flight.py's
GroupsInFlight, which this class extends with the episodes' runs on the workers.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError

from rayrl.orchestration.groups_in_flight import GroupsInFlight
from rayrl.rl.failures import STEP_DEADLINE, WORKER_DIED, fail
from rayrl.rl.groups import Group
from rayrl.types import Episode

logger = logging.getLogger("rayrl.dispatch")


class GroupDispatcher(GroupsInFlight):
    """Bounded-concurrency episode dispatch over rollout workers, with re-queue on worker death."""

    def __init__(
        self,
        workers: list[Any],
        group_size: int,
        limit: int,
        restart_worker: Callable[[int], Any],
        max_retries: int = 2,
    ) -> None:
        super().__init__(group_size)
        self.workers = list(workers)
        self.limit = limit
        self.restart_worker = restart_worker
        self.max_retries = max_retries
        self.running: dict[Any, tuple[str, int, int]] = {}  # ref -> (group_id, index, worker slot)
        self._ran_on: dict[Any, Any] = {}  # ref -> the worker handle it was sent to
        self.retry: deque[tuple[str, int]] = deque()  # episodes to run again
        self.counts: Counter = Counter()
        self._next_worker = 0
        self._dead_handles: set[Any] = set()

    # -- what to run -------------------------------------------------------------------------------

    def _launch(self, group: Group, index: int) -> None:
        k = self._next_worker % len(self.workers)
        self._next_worker += 1
        ref = self.workers[k].run_episode.remote(group.task, group.group_id, index)
        self.running[ref] = (group.group_id, index, k)
        self._ran_on[ref] = self.workers[k]

    def pump(self) -> None:
        """Start re-queued episodes, then queued groups while fewer than ``limit`` are active."""
        while self.retry:
            group_id, index = self.retry.popleft()
            if group_id in self.active:
                self._launch(self.active[group_id], index)
        while self.queue and len(self.active) < self.limit:
            group = self.queue.popleft()
            self.active[group.group_id] = group
            for index in range(group.size):
                self._launch(group, index)

    # -- results -----------------------------------------------------------------------------------

    def poll(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for finished episodes; returns how many came back."""
        self.pump()
        if not self.running:
            if timeout > 0:
                time.sleep(min(timeout, 0.05))
            return 0
        ready, rest = ray.wait(list(self.running), num_returns=1, timeout=timeout)
        if not ready:
            return 0
        if rest:  # everything else already done, without waiting again
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in ready:
            self._collect(ref)
        self.pump()
        return len(ready)

    def _collect(self, ref: Any) -> None:
        group_id, index, k = self.running.pop(ref)
        handle = self._ran_on.pop(ref)
        group = self.active.get(group_id)
        try:
            episode = ray.get(ref)
        except RayActorError as err:  # the worker died: run the episode again elsewhere
            self._worker_died(k, handle, err)
            if group is None:
                return
            group.attempts[index] += 1
            if group.attempts[index] <= self.max_retries:
                self.counts["episodes_requeued"] += 1
                self.retry.append((group_id, index))
                return
            episode = fail(Episode(session_id="", task_id=group.task.task_id, group_id=group_id), WORKER_DIED,
                           f"the rollout worker died {group.attempts[index]} times: {type(err).__name__}")
        except Exception as err:  # the episode call itself raised (it should not): fail it, go on
            episode = fail(Episode(session_id="", task_id=group.task.task_id if group else "", group_id=group_id),
                           WORKER_DIED, f"the rollout worker failed: {type(err).__name__}: {err}")
        if group is None:
            return
        episode.info.setdefault("index", index)
        group.episodes[index] = episode
        if group.complete:
            del self.active[group_id]
            self.completed.append(group)

    def _worker_died(self, k: int, handle: Any, err: Exception) -> None:
        """Count and log a worker's death once (each of its episodes reports it) and replace it."""
        if handle in self._dead_handles or self.workers[k] is not handle:
            return
        self._dead_handles.add(handle)
        self.counts["rollout_worker_deaths"] += 1
        logger.warning("rollout worker %d died (%s); re-queueing its episodes and starting a new one",
                       k, type(err).__name__)
        self.workers[k] = self.restart_worker(k)

    def fail_unfinished(self, reason: str) -> list[Group]:
        """Stop every started group now (sync schedule's deadline): cancel, fail what is missing."""
        for ref, (group_id, index, _) in list(self.running.items()):
            ray.cancel(ref)
            group = self.active.get(group_id)
            if group is not None:
                group.episodes[index] = fail(Episode(session_id="", task_id=group.task.task_id, group_id=group_id),
                                             STEP_DEADLINE, reason)
        self.running.clear()
        self._ran_on.clear()
        self.retry.clear()
        groups = list(self.active.values())
        self.active.clear()
        return groups

    # -- checkpoint ----------------------------------------------------------------------------------

    def drop(self) -> None:
        """Forget every group in flight and cancel their running episodes (their results are ignored)."""
        for ref in self.running:
            ray.cancel(ref)
        self.running.clear()
        self._ran_on.clear()
        self.retry.clear()
        super().drop()
