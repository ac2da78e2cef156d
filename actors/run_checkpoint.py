"""RunCheckpoints: save, resume and the exact way back after a trainer rank died.

A checkpoint holds the trainer (weights, optimizer, each rank's RNG), the data cursor, the step, the
policy version and the schedule's untrained groups: every group taken for a step that has not trained
yet, then every group queued, running or complete (the sampler's cursor is already past their tasks),
in order. On resume those tasks run first, so a killed run neither repeats nor skips a task. Storage is
rayrl.checkpoint.CheckpointStore (a directory or s3://; ``pipeline.json`` committed last, so a save cut
short, even by SIGKILL, is ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any, Optional

from actors.dispatch import GroupDispatcher
from actors.schedules import Schedule
from actors.trainer import TrainerFailure, TrainerGroup
from rayrl.checkpoint import CheckpointError, CheckpointStore
from rayrl.data import TaskSampler
from rayrl.rl.groups import Group

logger = logging.getLogger("rayrl.pipeline")


class RunCheckpoints:
    """The run's checkpoints over its trainer, sampler, dispatcher and schedule."""

    def __init__(self, store: CheckpointStore, trainer: TrainerGroup, sampler: TaskSampler,
                 dispatcher: GroupDispatcher, schedule: Schedule, run_dir: Path) -> None:
        self.store = store
        self.trainer = trainer
        self.sampler = sampler
        self.dispatcher = dispatcher
        self.schedule = schedule
        self.state = schedule.state
        self.run_dir = run_dir
        self.untrained_taken: list[Group] = []  # groups taken for the current step until it trains

    def check_shared(self) -> None:
        """A directory location must be one every trainer rank's node sees (ranks write their files
        there); checked at start with a probe file, not at the first save hours later."""
        if self.store.s3 is not None:
            return
        root = Path(self.store.location).resolve()
        probe = root / f".rayrl-probe-{uuid.uuid4().hex}"
        probe.write_text("")
        try:
            unseen = self.trainer.unseen_by(str(probe))
        finally:
            probe.unlink(missing_ok=True)
        if unseen:
            raise CheckpointError(
                f"pipeline.checkpoint_dir: {root} is not visible from the node(s) of trainer rank(s) {unseen}; on "
                "several nodes use s3://bucket/prefix or a filesystem every node mounts (docs/multinode.md)")

    def save(self, only_rank0: bool = False) -> str:
        """Write a checkpoint of the current step; returns where it lives."""
        step = self.state.step
        directory = self.store.staging_dir(step).resolve()
        self.trainer.save_checkpoint(str(directory), only_rank0=only_rank0, store=self.store, step=step)
        state = {"step": step, "policy_version": self.state.version,
                 "sampler": self.sampler.state_dict(), "schedule": self.schedule_state()}
        where = self.store.commit(step, state, upload_staged=False)  # the ranks' nodes uploaded their files
        print(f"[rayrl] checkpoint: {where}", flush=True)
        return where

    def schedule_state(self) -> dict[str, Any]:
        taken = [{"task": dataclasses.asdict(g.task), "group_id": g.group_id} for g in self.untrained_taken]
        return {**self.schedule.state_dict(), "untrained_groups": taken + self.dispatcher.untrained_tasks()}

    def latest(self) -> Optional[str]:
        """Where the newest complete checkpoint lives, or None."""
        step = self.store.latest()
        return None if step is None else self.store.location_of(step)

    def resume(self) -> bool:
        """Load the newest complete checkpoint and queue its untrained groups (fresh episodes: those in
        flight were lost, or, on a live pipeline, are dropped). The caller pushes the loaded weights to the
        engines."""
        step = self.store.latest()
        if step is None:
            print(f"[rayrl] no checkpoint at {self.store.location}; starting fresh", flush=True)
            return False
        saved = self.store.read_state(step)
        self.state.version = self.trainer.load_checkpoint(str(self.store.restore_dir(step).resolve()),
                                                          store=self.store, step=step)
        self.state.step = int(saved["step"])
        self.sampler.load_state_dict(saved["sampler"])
        schedule = saved.get("schedule") or {}
        self.state.group_seq = int(schedule.get("group_seq", self.state.group_seq))
        self.dispatcher.restore(schedule.get("untrained_groups", []))
        print(f"[rayrl] resumed from {self.store.location_of(step)} at step {self.state.step}, "
              f"policy version {self.state.version}", flush=True)
        return True

    def after_trainer_failure(self, failure: TrainerFailure) -> None:
        """A trainer rank died: leave a checkpoint that resumes exactly, and say how to resume.

        Rank 0 that did not step holds the weights from before this step (the state after the previous
        step), so the newest checkpoint, or a new one of the previous step with this step's groups marked
        untrained, resumes exactly. Rank 0 that stepped holds this step's result: it is saved as this step.
        Rank 0 gone: the newest checkpoint is the way back.
        """
        self.state.failures["trainer_rank_failures"] += 1
        if failure.rank0_alive and failure.rank0_stepped:
            self.state.version += 1
            self.untrained_taken = []
            where: Optional[str] = self.save(only_rank0=True)
        elif failure.rank0_alive:
            self.state.step -= 1
            existing = self.store.latest()
            where = self.store.location_of(existing) if existing == self.state.step else self.save(only_rank0=True)
        else:
            where = self.latest()
        resume = (f"python driver.py --config {self.run_dir / 'config.yaml'} --resume" if where
                  else "no checkpoint exists: start the run again")
        message = f"{failure}. Checkpoint: {where or 'none'}. Resume with: {resume}"
        logger.error(message)
        print(f"[rayrl] run stopped: {message}", flush=True)
