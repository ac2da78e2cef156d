"""RunCheckpoints: save, resume and the exact way back after a trainer rank died.

After a trainer rank failure in any phase (rollout, train, weight push, offload/onload, checkpoint),
:meth:`RunCheckpoints.after_trainer_failure` writes the last completed step from a surviving rank
(where one rank holds the whole state: the torch backend's data-parallel ranks), or points at the
newest checkpoint, and prints one line: the cause, the checkpoint and the command that resumes.

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
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from rayrl.checkpoint import CheckpointError, CheckpointStore
from rayrl.data import TaskSampler
from rayrl.orchestration.part_failures import TrainerFailure
from rayrl.orchestration.parts import Dispatcher, Trainer
from rayrl.orchestration.schedules import Schedule
from rayrl.rl.groups import Group

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreloadedCheckpoint:
    """A checkpoint the trainer loaded as it started (``--resume``): which step, the policy version it
    holds, and the seconds it took (overlapped with the engines' and the other parts' start)."""

    step: int
    version: int
    seconds: float


def preload_checkpoint(trainer: Any, store: CheckpointStore) -> Optional[PreloadedCheckpoint]:
    """Load the newest checkpoint into ``trainer`` right after it started, on the start's trainer thread
    (rayrl/orchestration/start_together.py): on a resume this wait then overlaps the engines' start instead of
    following it. None (nothing loaded; :meth:`RunCheckpoints.resume` then loads as before, with its
    errors) when there is no checkpoint, or a trainer rank's node does not see the checkpoint directory."""
    step = store.latest()
    if step is None:
        return None
    started = time.monotonic()
    directory = str(store.restore_dir(step).resolve())
    if store.s3 is None and trainer.unseen_by(directory):
        return None
    version = trainer.load_checkpoint(directory, store=store, step=step)
    return PreloadedCheckpoint(step, int(version), round(time.monotonic() - started, 3))


class RunCheckpoints:
    """The run's checkpoints over its trainer, sampler, dispatcher and schedule."""

    def __init__(self, store: CheckpointStore, trainer: Trainer, sampler: TaskSampler,
                 dispatcher: Dispatcher, schedule: Schedule, run_dir: Path) -> None:
        self.store = store
        self.trainer = trainer
        self.sampler = sampler
        self.dispatcher = dispatcher
        self.schedule = schedule
        self.state = schedule.state
        self.run_dir = run_dir
        self.untrained_taken: list[Group] = []  # groups taken for the current step until it trains
        self.step_version = 0  # the policy version when the current step started
        self.step_done = False  # the current step has trained (or had nothing to train)

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

    def save(self, from_rank: Optional[int] = None, announce: bool = True) -> str:
        """Write a checkpoint of the current step (``from_rank``: that rank alone writes the trainer's
        state, after a rank failure); returns where it lives."""
        step = self.state.step
        directory = self.store.staging_dir(step).resolve()
        self.schedule.with_trainer_memory(  # colocated: the trainer is offloaded outside its train phase
            lambda: self.trainer.save_checkpoint(str(directory), from_rank=from_rank, store=self.store, step=step))
        state = {"step": step, "policy_version": self.state.version,
                 "sampler": self.sampler.state_dict(), "schedule": self.schedule_state()}
        where = self.store.commit(step, state, upload_staged=False)  # the ranks' nodes uploaded their files
        if announce:
            print(f"[rayrl] checkpoint: {where}", flush=True)
        return where

    def start_step(self) -> None:
        """A step begins (the pipeline calls this before it collects the step's groups)."""
        self.step_version = self.state.version
        self.step_done = False

    def step_trained(self) -> None:
        """The step's groups trained (or had nothing to train): they are no longer untrained."""
        self.untrained_taken = []
        self.step_done = True

    def schedule_state(self) -> dict[str, Any]:
        taken = [{"task": dataclasses.asdict(g.task), "group_id": g.group_id} for g in self.untrained_taken]
        return {**self.schedule.state_dict(), "untrained_groups": taken + self.dispatcher.untrained_tasks()}

    def latest(self) -> Optional[str]:
        """Where the newest complete checkpoint lives, or None."""
        step = self.store.latest()
        return None if step is None else self.store.location_of(step)

    def resume_command(self, where: Optional[str]) -> str:
        """What a stopped run prints after "Resume with:": the command, or, with no checkpoint (``where``
        None), that the run starts again."""
        if where is None:
            return "no checkpoint exists: start the run again"
        return f"python driver.py --config {self.run_dir / 'config.yaml'} --resume"

    def resume(self, preloaded: Optional[PreloadedCheckpoint] = None) -> bool:
        """Load the newest complete checkpoint and queue its untrained groups (fresh episodes: those in
        flight were lost, or, on a live pipeline, are dropped). The trainer loads where its memory is live
        (the schedule's ``with_trainer_memory``), unless it loaded this step as it started (``preloaded``);
        the caller has the schedule push the loaded weights to the engines (``weights_loaded``)."""
        step = self.store.latest()
        if step is None:
            print(f"[rayrl] no checkpoint at {self.store.location}; starting fresh", flush=True)
            return False
        saved = self.store.read_state(step)

        def load() -> None:
            self.state.version = self.trainer.load_checkpoint(str(self.store.restore_dir(step).resolve()),
                                                              store=self.store, step=step)

        if preloaded is not None and preloaded.step == step:
            self.state.version = preloaded.version
        else:
            self.schedule.with_trainer_memory(load)
        self.state.step = int(saved["step"])
        self.sampler.load_state_dict(saved["sampler"])
        schedule = saved.get("schedule") or {}
        self.state.group_seq = int(schedule.get("group_seq", self.state.group_seq))
        self.state.episodes = int(schedule.get("episodes", self.state.episodes))
        untrained = schedule.get("untrained_groups", [])
        if schedule.get("episodes_counted") != "queued":  # an older checkpoint counted groups when taken: the
            # groups it restores were not all in its count; counting them all keeps the budget from being exceeded
            self.state.episodes += len(untrained) * self.schedule.cfg.rollout.group_size
        self.dispatcher.restore(untrained)
        print(f"[rayrl] resumed from {self.store.location_of(step)} at step {self.state.step}, "
              f"policy version {self.state.version}", flush=True)
        return True

    def after_trainer_failure(self, failure: TrainerFailure, save: bool = True) -> None:
        """A trainer rank died: leave a checkpoint that resumes exactly, and say how to resume, in one line.
        ``save=False``: nothing trained since the newest checkpoint (a failure while resuming from it), which
        is the way back as it is.

        The surviving rank with the newest weights writes the last completed step, whatever the phase:
        if it holds this step's update (the failure came after the trainer step: weight push, offload,
        checkpoint), this step, its groups trained; if not (rollout, onload, train), the previous step,
        with this step's groups marked untrained (unless that checkpoint exists already). Where no rank
        holds the whole state (Megatron shards it) or none survived, the newest checkpoint is the way back.
        """
        self.state.failures["trainer_rank_failures"] += 1
        where = None
        try:
            where = self._save_from_survivor(failure) if save else None
        except Exception as err:  # another rank went too, or the store failed: fall back to the newest
            logger.warning("checkpoint from a surviving trainer rank failed: %s",
                           str(err).strip().splitlines()[0])
        where = where or self.latest()
        print(f"[rayrl] run stopped: {failure}. Checkpoint: {where or 'none'}. Resume with: "
              f"{self.resume_command(where)}", flush=True)

    def _save_from_survivor(self, failure: TrainerFailure) -> Optional[str]:
        if not failure.survivors or not self.trainer.full_state_on_every_rank:
            return None
        version = max(failure.survivors.values())
        rank = min(r for r, v in failure.survivors.items() if v == version)
        if self.step_done or version > self.step_version:  # it holds this step's update
            self.state.version = version
            self.step_trained()
        else:  # the state after the previous step; this step's groups are untrained
            self.state.step -= 1
            self.state.version = version
            if self.store.latest() == self.state.step:
                return self.store.location_of(self.state.step)
        return self.save(from_rank=rank, announce=False)
