"""The three schedules: how rollout and training share time. One class each, one interface.

Episodes run as groups (``rollout.group_size`` episodes of one task) that a GroupDispatcher
(actors/dispatch.py; here the ``Dispatcher`` protocol of rayrl/orchestration/parts.py) keeps moving on the
rollout workers; each step takes ``prompts_per_step`` completed groups. The pipeline (actors/pipeline.py)
picks the class once from ``pipeline.schedule`` and then only calls :meth:`Schedule.collect` and
:meth:`Schedule.train`. One step of each:

``sync``
    1. queue ``prompts_per_step`` new tasks; wait until their groups complete (or the step deadline); a
       group where infrastructure failures left fewer than ``rollout.min_group_episodes`` scored episodes
       runs its task again (every schedule does this: those failures say nothing about the policy; the
       agent's own failures are scored and never rerun); with ``algorithm.dynamic_sampling`` a group whose
       rewards are all equal is dropped and another drawn; with ``pipeline.episode_budget`` a group is
       queued (a rerun too) only while the budget has room for all its episodes, so the step that runs
       out of budget stops drawing and trains on what it kept;
    2. (pipeline) advantages (``algorithm.advantage_estimator``, GRPO by default) over each group's scored
       episodes (rayrl/rl/batch.py);
    3. one trainer step (nothing else runs);
    4. new weights to every engine with the next policy version (after a step deadline cut groups, whose
       episodes' LLM calls may still run at the engines, with nothing generating, as async does).

``async`` (disaggregated)
    1. keep ``groups_in_flight`` groups queued or running; take the first ``prompts_per_step`` groups
       that complete; a group with tokens more than ``max_staleness`` versions old is dropped (counted)
       and its task queued again; the groups queued ahead count against ``pipeline.episode_budget`` when
       queued, so prefetch never runs past it;
    2. as in sync;
    3. one trainer step while the episodes go on (engines keep generating; new groups start);
    4. new weights to the engines with nothing generating: the gateway holds new LLM calls, the engines
       ``pause_generation(abort)`` (running generations return; the gateway continues each from its
       tokens so far once generation continues), the engines polled until idle (``/flush_cache``
       succeeds: an aborted request leaves SGLang's batch only at its scheduler's next step, and an update
       that flushes the cache asserts that none is left), the update, ``continue_generation``. SGLang takes an
       update's writer lock only between generations and reports no per-token versions (0.5.9), so an
       update under traffic would wait for running generations and let requests admitted between two
       buckets run on half-updated weights; this way each part of a generation has one version, recorded
       per token by the gateway, and the loss corrects with truncated importance sampling.

``colocated_async`` (engines and trainer share devices)
    0. at setup the engines have released their memory (actors/pipeline.py, while the trainer was built)
       and take the devices back as in 4., the trainer's initial weights pushed first: SGLang 0.5.9 keeps
       no CPU copy of released weights (``enable_weights_cpu_backup`` is off by default), so resumed
       weights are garbage until a push (slime pushes right after loading too);
    1.-2. as in async;
    3. hand the devices to the trainer: the gateway holds new LLM calls; in-flight generations finish
       (or, with ``partial_rollout``, are aborted and later continued); engines ``pause_generation``, are
       polled until idle (SGLang asserts that no request runs on release) and
       ``release_memory_occupation``; ``trainer.onload()``; train while episodes keep doing their tool
       and sandbox work;
    4. engines ``resume_memory_occupation(weights)``; the weight update, read from the trainer's live
       memory; a broadcast group (``distributed``) is destroyed; ``trainer.offload()`` (on NCCL its process
       groups are destroyed, then its memory paused; onload makes them again: rayrl/trainers/
       process_groups.py); engines ``resume_memory_occupation(kv_cache, cuda_graph)`` and
       ``continue_generation``; the gateway lets the held calls go on the new weights. The push comes
       before the offload because offload unmaps the trainer's memory (torch_memory_saver): an export
       after it reads unmapped memory (slime pushes from a host copy instead; docs/gpu.md compares).
    Anything else that reads or writes the trainer (a checkpoint save, a resume's load, the weights for
    a replacement engine) runs outside the train phase through :meth:`Schedule.with_trainer_memory`:
    3. without training, then 4. (the engines lost their weights at the release, so they are pushed).

While any schedule waits, :meth:`Schedule.tick` keeps the dispatch going and lets the engine membership
(rayrl/orchestration/membership.py) tend the engines: an engine that died is taken out of the routers and
replaced on its bundle; the replacement gets the current weights before the routers learn its address
(colocated: only once the devices are back). "Hold LLM calls" below is the gateway's routers queueing
new calls; "pause_generation" is always the engines' own SGLang call.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from rayrl.orchestration.membership import EngineMembership
from rayrl.orchestration.parts import RunParts
from rayrl.rl.batch import Batch
from rayrl.rl.groups import Group, equal_reward, split_short, split_stale
from rayrl.types import Task

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how long one dispatch turn waits for finished episodes


class Schedule:
    """``sync``; the base of the others. Subclasses change how far rollout runs ahead and what happens
    around the trainer step."""

    name = "sync"
    # its traits (the table is :data:`SCHEDULES`; rayrl/resolve.py and actors/pipeline.py ask these, never the name)
    runs_ahead = False  # keep groups_in_flight groups going while a step trains (async schedules)
    exclusive_devices = True  # rollout and training take the devices in turn: on CPU each side gets every core
    tis_cap = 0.0  # algorithm.tis_cap when unset: off where no sample is stale (a narrow-band loss turns it on)

    # whether the trainer is built only once the engines are up and :meth:`before_trainer` ran; otherwise the
    # two start together (actors/pipeline.py, rayrl/orchestration/start_together.py)
    trainer_after_engines = False

    @staticmethod
    def before_trainer(engines: Any) -> None:
        """Setup hook: what the engines do before the trainer is built (actors/pipeline.py, step 3)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.state = parts.state
        self.dropped: list[Group] = []  # this step's groups dynamic sampling dropped (recorded, not trained)
        self.rerun_refused: set[str] = set()  # groups the budget refused a rerun: each is counted once
        self.generations_cut = False  # sync: the step deadline failed groups whose LLM calls may still run
        self.membership = EngineMembership(parts.engines, parts.weights, parts.gateway, parts.state.failures)

    # -- the dispatch loop ---------------------------------------------------------------------------

    def queue_new_groups(self, target: int) -> None:
        """Queue tasks from the sampler until ``target`` groups are in flight, or until the episode budget
        has no room for another group."""
        dispatcher = self.parts.dispatcher
        while dispatcher.groups_in_flight < target and self.budget_allows_group():
            self.queue_group(self.parts.sampler.next(1)[0])

    def queue_group(self, task: Task, **submit: Any) -> None:
        """Submit ``task`` as a new group (its id numbered in queue order), its episodes counted against the
        budget now."""
        self.state.group_seq += 1
        self.state.episodes += self.cfg.rollout.group_size
        self.parts.dispatcher.submit(task, f"g{self.state.group_seq:06d}-{task.task_id}", **submit)

    # -- the episode budget --------------------------------------------------------------------------

    def budget_allows_group(self) -> bool:
        """Whether one more whole group fits in ``pipeline.episode_budget`` (0: no budget, always). Episodes
        count when their group is queued, not when it completes: the groups an async schedule keeps in
        flight ahead of training are already paid for, so prefetch cannot run the budget over."""
        budget = self.cfg.pipeline.episode_budget
        return budget <= 0 or self.state.episodes + self.cfg.rollout.group_size <= budget

    @property
    def budget_spent(self) -> bool:
        """The budget has no room for another group and every group it paid for was taken: no step could
        take anything more (the pipeline ends the run)."""
        return (self.cfg.pipeline.episode_budget > 0 and not self.budget_allows_group()
                and self.parts.dispatcher.groups_in_flight == 0)

    def tick(self) -> None:
        """One turn of the dispatch loop while the driver waits on something else."""
        if self.runs_ahead:
            self.queue_new_groups(self.cfg.pipeline.groups_in_flight)
        self.parts.dispatcher.poll(POLL_S)
        self.membership.tend(self.engines_may_join(), self.state.version, self.update_engines)

    def while_dispatching(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a blocking call to the trainer or the gateway) while episodes keep being dispatched
        and engines tended."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-phase") as pool:
            future = pool.submit(fn)
            while not future.done():
                self.tick()
            return future.result()

    # -- engines that die and come back ------------------------------------------------------------

    def engines_may_join(self) -> bool:
        """Whether a replacement engine may start, take its weights and traffic now (the membership asks
        at every tick)."""
        return True

    # -- one step ------------------------------------------------------------------------------------

    def collect(self, counts: Counter) -> list[Group]:
        """The step's ``prompts_per_step`` groups; drops are counted in ``counts``."""
        cfg, dispatcher = self.cfg, self.parts.dispatcher
        need = cfg.rollout.prompts_per_step
        if not self.runs_ahead:
            self.queue_new_groups(need)
        self.dropped = []
        deadline = time.monotonic() + cfg.rollout.step_deadline_s if cfg.rollout.step_deadline_s > 0 else None
        enough = int(np.ceil(cfg.rollout.min_groups_fraction * need))
        taken: list[Group] = []
        with tqdm(total=need * cfg.rollout.group_size, desc=f"step {self.state.step} rollout", unit="ep",
                  leave=False, dynamic_ncols=True) as bar:
            while len(taken) < need:
                if not self.runs_ahead:  # groups dynamic sampling dropped are replaced by new ones
                    self.queue_new_groups(need - len(taken))
                self.tick()
                got = dispatcher.take(need - len(taken))
                fresh = self.keep_varied(self.keep_fresh(self.keep_full(got, counts), counts), counts)
                if fresh:
                    taken += fresh
                    bar.update(sum(g.size for g in fresh))
                if len(taken) < need and self.budget_spent:  # nothing left to take, no room to draw more
                    counts["budget_stopped_draws"] = need - len(taken)
                    logger.info("step %d: the episode budget (%d) is spent; training on the %d group(s) kept, "
                                "%d short of %d", self.state.step, cfg.pipeline.episode_budget, len(taken),
                                need - len(taken), need)
                    break
                if deadline is not None and time.monotonic() > deadline and self.deadline_ends_step(len(taken), enough):
                    break
        if len(taken) < need and not self.runs_ahead:
            cut = dispatcher.fail_unfinished("step deadline reached")
            self.generations_cut = self.generations_cut or bool(cut)
            taken += cut
        return taken

    def rerun(self, group: Group) -> None:
        """Run ``group``'s task again, first in the queue, as a new group: not lost, not trained twice."""
        self.queue_group(group.task, front=True, reruns=group.reruns + 1)

    def budget_refuses_rerun(self, group: Group, counts: Counter) -> bool:
        """True (counted as ``pipeline/budget_skipped_reruns``, logged) where the episode budget has no room
        to run ``group``'s task again. A group refused twice in one step (short, then stale) counts once."""
        if self.budget_allows_group():
            return False
        if group.group_id in self.rerun_refused:
            return True
        self.rerun_refused.add(group.group_id)
        counts["budget_skipped_reruns"] += 1
        logger.info("group %s (task %s) not run again: the episode budget (%d) has no room for it",
                    group.group_id, group.task.task_id, self.cfg.pipeline.episode_budget)
        return True

    def set_aside(self, group: Group, why: str) -> None:
        """Keep a group that will not train for the step's records (``why``: rerun | stale): its episodes
        are written and its failures counted once, like those of the groups that train."""
        for episode in group.episodes.values():
            episode.info["discarded"] = why
        self.state.set_aside.append(group)

    def keep_full(self, groups: list[Group], counts: Counter) -> list[Group]:
        """Groups with enough scored episodes (``rollout.min_group_episodes``); the others, short because
        infrastructure failed their episodes, run again (``pipeline.max_group_reruns`` times at most, and
        only while the episode budget has room for them; then they are kept as they are)."""
        need = self.cfg.rollout.min_group_episodes
        _, short = split_short(groups, need, self.cfg.pipeline.max_group_reruns)
        run_again: list[Group] = []
        for group in short:
            if self.budget_refuses_rerun(group, counts):
                continue  # kept as it is
            run_again.append(group)
            counts["rerun_short_groups"] += 1
            causes = ", ".join(f"{kind} x{n}" for kind, n in group.infra_causes().most_common())
            logger.warning("group %s (task %s): infrastructure failed %d of %d episodes (%s); running the task "
                           "again (rerun %d of at most %d)", group.group_id, group.task.task_id,
                           group.size - group.scored, group.size, causes, group.reruns + 1,
                           self.cfg.pipeline.max_group_reruns)
            self.set_aside(group, "rerun")
            self.rerun(group)
        keep = [g for g in groups if all(g is not r for r in run_again)]  # in the order they were drawn
        counts["short_groups_kept"] += sum(1 for g in keep if g.scored < min(need, g.size))
        return keep

    def keep_fresh(self, groups: list[Group], counts: Counter) -> list[Group]:
        """The groups a step may train (sync: all; every group was started on the current weights)."""
        return groups

    def keep_varied(self, groups: list[Group], counts: Counter) -> list[Group]:
        """DAPO's dynamic sampling (``algorithm.dynamic_sampling``): drop groups whose rewards are all equal
        (counted by reward, ``pipeline/dynamic_dropped_reward_<r>``); more groups are drawn in their place.
        Once the step has drawn ``dynamic_sampling_max_groups`` groups, equal groups are kept
        (``pipeline/dynamic_kept_equal``), so a step never waits for ever."""
        algo = self.cfg.algorithm
        if not algo.dynamic_sampling:
            return groups
        keep = []
        for group in groups:
            counts["dynamic_groups_drawn"] += 1
            reward = equal_reward(group)
            if reward is None:
                keep.append(group)
            elif counts["dynamic_groups_drawn"] > algo.dynamic_sampling_max_groups:
                counts["dynamic_kept_equal"] += 1
                keep.append(group)
            else:
                counts["dynamic_dropped_groups"] += 1
                counts[f"dynamic_dropped_reward_{reward:g}"] += 1
                self.dropped.append(group)
        return keep

    def deadline_ends_step(self, taken: int, enough: int) -> bool:
        """Past the step deadline: sync stops waiting (the unfinished groups fail)."""
        return True

    def train(self, batch: Batch) -> dict[str, Any]:
        """One trainer step on ``batch``, then the new weights on every engine."""
        metrics = self.train_on(batch)
        started = time.monotonic()
        self.update_engines()
        metrics["time/weight_sync_s"] = time.monotonic() - started
        return metrics

    def update_engines(self) -> None:
        """The new weights to every engine (sync: nothing is generating now, unless the step deadline cut
        episodes whose LLM calls may still run at the engines: then as async does)."""
        if self.generations_cut:
            self.generations_cut = False
            self.update_with_nothing_generating()
        else:
            self.membership.push_weights(self.state.version)

    def update_with_nothing_generating(self) -> None:
        """The gateway holds new calls, the engines abort what runs (the gateway continues it after) and are
        polled until idle, update, continue: SGLang asserts after an update that flushes the cache that no
        request is running."""
        parts = self.parts
        parts.gateway.hold_llm_calls()
        try:
            parts.engines.pause_generation("abort")
            parts.engines.wait_idle()  # aborted requests leave the batch at the next scheduler step
            self.membership.push_weights(self.state.version)
            parts.engines.continue_generation()
        finally:
            parts.gateway.release_llm_calls()

    def with_trainer_memory(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a checkpoint save or load) where the trainer's memory is live (sync, async: always)."""
        return fn()

    def weights_loaded(self) -> None:
        """A checkpoint was loaded into the trainer (resume): its weights to the engines, nothing generating
        yet."""
        if self.state.version > 0:
            self.membership.push_weights(self.state.version)

    def train_on(self, batch: Batch) -> dict[str, Any]:
        """The trainer step; advances the policy version; ``train/*`` and ``time/train_s``."""
        started = time.monotonic()
        train = self.train_step(batch)
        self.state.version = int(train["policy_version"])
        return {"time/train_s": time.monotonic() - started, **{f"train/{k}": v for k, v in train.items()}}

    def train_step(self, batch: Batch) -> dict[str, Any]:
        """The trainer's step (sync: nothing else is running)."""
        return self.parts.trainer.train(batch.samples, batch.train_advantages())

    def state_dict(self) -> dict[str, Any]:
        """``episodes_counted: queued`` marks the count's meaning since the budget became exact (checkpoints
        before it counted groups when taken: rayrl/orchestration/run_checkpoint.py adds their untrained groups)."""
        return {"schedule": self.name, "group_seq": self.state.group_seq, "episodes": self.state.episodes,
                "episodes_counted": "queued"}


class AsyncSchedule(Schedule):
    """``async``: rollout runs ahead of training; groups older than ``max_staleness`` are dropped."""

    name = "async"
    runs_ahead = True
    exclusive_devices = False  # engines and trainer run at once: each side gets half the cores
    tis_cap = 2.0  # samples can be stale: the truncated importance weight corrects them

    def keep_fresh(self, groups: list[Group], counts: Counter) -> list[Group]:
        """Drop (count, re-queue in front) groups with tokens more than ``max_staleness`` versions old: the
        task runs again on newer weights, so it is neither lost nor trained twice (unless the episode
        budget has no room for it: ``pipeline/budget_skipped_reruns``)."""
        version = self.state.version
        fresh, stale = split_stale(groups, version, self.cfg.pipeline.max_staleness)
        for group in stale:
            counts["dropped_stale_groups"] += 1
            counts["dropped_stale_samples"] += sum(len(e.samples) for e in group.episodes.values())
            logger.info("group %s dropped: %d policy versions old", group.group_id, group.staleness(version))
            self.set_aside(group, "stale")
            if not self.budget_refuses_rerun(group, counts):
                self.rerun(group)
        return fresh

    def deadline_ends_step(self, taken: int, enough: int) -> bool:
        """Past the deadline, the step goes on with ``min_groups_fraction`` of its groups; the rest keep
        running for the next step."""
        return taken >= enough

    def train_step(self, batch: Batch) -> dict[str, Any]:
        return self.while_dispatching(lambda: self.parts.trainer.train(batch.samples, batch.train_advantages()))

    def update_engines(self) -> None:
        """The new weights with nothing generating (step 4 in the module docstring)."""
        self.update_with_nothing_generating()


class ColocatedAsyncSchedule(AsyncSchedule):
    """``colocated_async``: as async, but engines and trainer take the devices in turn around each step."""

    name = "colocated_async"
    exclusive_devices = True

    trainer_after_engines = True  # the trainer is built in the memory the engines release

    @staticmethod
    def before_trainer(engines: Any) -> None:
        """The engines release their memory while the trainer is built on the same devices; they take it back
        once the trainer is offloaded (:meth:`engines_take_devices`)."""
        engines.release_memory_occupation()

    def __init__(self, parts: RunParts) -> None:
        super().__init__(parts)
        # the engines released their memory while the trainer was built (actors/pipeline.py): the devices are
        # the trainer's; the engines take them back with the trainer's weights pushed first, as after every
        # step (SGLang resumes released weights without their contents unless enable_weights_cpu_backup)
        self.devices_with_trainer = True
        self.engines_take_devices()

    def engines_may_join(self) -> bool:
        return not self.devices_with_trainer  # a new engine's memory would collide with the trainer's

    def train(self, batch: Batch) -> dict[str, Any]:
        parts = self.parts
        started = time.monotonic()
        self.give_devices_to_trainer()
        pause_s = time.monotonic() - started
        metrics = self.train_on(batch)
        started = time.monotonic()
        metrics["gateway/queue_depth"] = parts.gateway.queue_depth()
        self.give_devices_to_engines()
        metrics["time/weight_sync_s"] = time.monotonic() - started
        metrics["time/engine_pause_s"] = pause_s
        return metrics

    def update_engines(self) -> None:
        """A replacement engine joins after a step: the weights are read from the trainer's live memory, so
        the devices go to the trainer and back, and every engine is sent the current version."""
        self.with_trainer_memory(lambda: None)

    def with_trainer_memory(self, fn: Callable[[], Any]) -> Any:
        """``fn`` (a checkpoint save or load) with the trainer's memory live: outside the train phase the
        trainer is offloaded, so the devices go to it first and come back with the weights it then holds
        pushed (a load changes them; the engines lost theirs when they released their memory)."""
        if self.devices_with_trainer:
            return fn()
        self.give_devices_to_trainer()
        result = fn()  # if it raises, the run stops: the devices stay with the trainer, whose failure path saves
        self.give_devices_to_engines()  # from its live memory, and no push masks the failure with its own
        return result

    def weights_loaded(self) -> None:
        """A resume loaded the trainer inside :meth:`with_trainer_memory`, which pushed its weights."""

    def give_devices_to_trainer(self) -> None:
        """Hold LLM calls at the gateway, stop (or finish) generation, free the engines' memory, onload the
        trainer."""
        parts, pipeline = self.parts, self.cfg.pipeline
        self.devices_with_trainer = True
        parts.gateway.hold_llm_calls()
        mode = "abort"  # partial_rollout: the gateway continues each aborted generation after the update
        if not pipeline.partial_rollout:
            mode = "in_place"  # nothing is running once the gateway drained
            if not self.while_dispatching(lambda: parts.gateway.drain(pipeline.generation_wait_timeout_s)):
                logger.warning("generations still running at the weight update after %.0f s; aborting them",
                               pipeline.generation_wait_timeout_s)
                self.state.failures["drain_timeouts"] += 1
                mode = "abort"
        parts.engines.pause_generation(mode)
        parts.engines.wait_idle()  # SGLang asserts no request is running on release
        parts.engines.release_memory_occupation()
        parts.trainer.onload()

    def give_devices_to_engines(self) -> None:
        """The engines take the devices back with the trainer's weights (step 4 of the module docstring),
        then generation continues and the gateway lets the held calls go."""
        self.engines_take_devices()
        self.parts.engines.continue_generation()
        self.parts.gateway.release_llm_calls()

    def engines_take_devices(self) -> None:
        """Engines' weights memory back, the trainer's weights pushed from its live memory (offload unmaps
        it), its broadcast group and memory released, the engines' KV cache and CUDA graphs back."""
        parts = self.parts
        parts.engines.resume_memory_occupation(["weights"])
        self.membership.push_weights(self.state.version)
        parts.weights.release_groups()  # NCCL groups hold GPU memory: the broadcast group's, then (offload)
        parts.trainer.offload()  # the trainer's own go with its memory
        parts.engines.resume_memory_occupation(["kv_cache", "cuda_graph"])
        self.devices_with_trainer = False


SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (Schedule, AsyncSchedule, ColocatedAsyncSchedule)}


def schedule_kind(name: str) -> type[Schedule]:
    """The row ``name`` (``pipeline.schedule``, whose Literal type lists these), its traits on the class."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {', '.join(SCHEDULES)}") from None


def make_schedule(parts: RunParts) -> Schedule:
    """The schedule ``pipeline.schedule`` names."""
    return schedule_kind(parts.cfg.pipeline.schedule)(parts)
