"""The pipeline: wires engines, trajectory managers, sandbox pool, rollout workers and trainer.

The order of phases lives here and nowhere else. Episodes run as groups (``group_size`` episodes of one
task) dispatched by a GroupDispatcher (actors/dispatch.py); each step takes ``prompts_per_step``
completed groups. One step of each ``pipeline.schedule``:

``sync``
    1. queue ``prompts_per_step`` new tasks; wait until their groups complete (or the step deadline);
    2. GRPO advantages per group over the episodes that succeeded (failed ones are counted, logged once,
       and excluded);
    3. one trainer step (nothing else runs);
    4. new weights to every engine with the next policy version;
    5. metrics, summary line, checkpoint when due.

``async`` (disaggregated)
    1. keep ``groups_in_flight`` groups queued or running; take the first ``prompts_per_step`` groups
       that complete; a group with tokens more than ``max_staleness`` versions old is dropped (counted)
       and its task queued again;
    2. advantages as in sync;
    3. one trainer step while the episodes go on (engines keep generating; new groups start);
    4. new weights to the engines; running generations switch between two decode steps and record
       which version made each token; the loss corrects with truncated importance sampling;
    5. as in sync.

``colocated_async`` (engines and trainer share devices)
    1.-2. as in async;
    3. hand the devices to the trainer: the gateway holds new LLM calls; in-flight generations finish
       (or, with ``partial_rollout``, are aborted and later continued); engines ``pause_generation`` and
       ``release_memory_occupation``; ``trainer.onload()``; train while episodes keep doing their tool
       and sandbox work; ``trainer.offload()``;
    4. engines ``resume_memory_occupation``, weight update, ``continue_generation``; the gateway lets the
       held calls go on the new weights;
    5. as in sync.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import ray
from tqdm import tqdm

from actors.dispatch import Group, GroupDispatcher, split_stale
from actors.engine import EngineGroup
from actors.placement import SharedPlacement
from actors.ray_metrics import RayMetricsSink
from actors.rollout_worker import RolloutWorker, start_workers
from actors.sandbox_pool import SandboxPoolActor
from actors.trainer import TrainerFailure, TrainerGroup
from actors.trajectory_manager import TrajectoryManagers, start_trajectory_managers
from rayrl.checkpoint import CheckpointStore
from rayrl.concurrency import (
    capacity_warnings,
    episodes_per_worker,
    groups_in_flight,
    with_rollout_concurrency,
)
from rayrl.config import RunConfig, to_yaml
from rayrl.data import JsonlDataset, TaskSampler
from rayrl.engines.launcher import resolve_backend
from rayrl.metrics import CounterDeltas, MetricsLogger, summary_line
from rayrl.models import resolve_model_path
from rayrl.placement import with_cpu_threads
from rayrl.trainers.losses import grpo_advantages
from rayrl.trainers.weight_transfer import resolve_weight_transfer
from rayrl.trainers.weights import shared_memory_root
from rayrl.types import Episode, Sample

logger = logging.getLogger("rayrl.pipeline")

ENGINE_CHECK_INTERVAL_S = 1.0  # how often the dispatch loop looks for dead engine processes (a cheap liveness poll)


class WeightSyncError(RuntimeError):
    """A weight update to the engines failed or did not finish within ``pipeline.weight_sync_timeout_s``."""


class Pipeline:
    """Builds every actor from one RunConfig and runs the training loop."""

    def __init__(self, cfg: RunConfig) -> None:
        cfg = with_rollout_concurrency(with_cpu_threads(cfg))  # recorded in the run's config.yaml
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.dataset = JsonlDataset(cfg.data.train_path, cfg.data.max_prompt_chars)
        self.sampler = TaskSampler(self.dataset, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.val_dataset = JsonlDataset(cfg.data.val_path, cfg.data.max_prompt_chars) if cfg.data.val_path else None
        self.weights_root = shared_memory_root() / f"rayrl-{cfg.exp_id}-weights"
        self.failure_counts: dict[str, int] = defaultdict(int)
        self.checkpoints = CheckpointStore(cfg.pipeline.checkpoint_dir or self.run_dir / "checkpoints",
                                           staging_root=self.run_dir / "checkpoint-staging",
                                           keep_last=cfg.pipeline.keep_checkpoints)
        self.checkpoints.verify()  # a bad bucket fails now, not at the first save
        self._untrained_taken: list[Group] = []  # groups taken for the current step until it trains
        self.step = 0
        self.version = 0

        log_dir = str((self.run_dir / "logs").resolve())
        # placement.mode colocated/split: trainer ranks and engines share one group of GPU bundles
        self.placement = SharedPlacement.from_config(cfg)
        engine_options = self.placement.engine_options(0) if self.placement is not None else {}
        print("[rayrl] starting engines...", flush=True)
        self.engines = EngineGroup.options(name=f"rayrl-{cfg.exp_id}-engines", **engine_options).remote(
            cfg.engine, self.model_path, log_dir,
            self.placement.all_engine_devices() if self.placement is not None else None,
        )
        self.engine_urls = ray.get(self.engines.urls.remote())
        print("[rayrl] starting trajectory managers, sandbox pool, rollout workers and trainer...", flush=True)
        self.trajectories: TrajectoryManagers = start_trajectory_managers(cfg, self.model_path, self.engine_urls)
        self.pool = SandboxPoolActor.options(name=f"rayrl-{cfg.exp_id}-sandbox-pool").remote(
            cfg.sandbox, cfg.sandbox_pool
        )
        workers = start_workers(cfg, self.trajectories.handles, self.pool)
        self.trainer = TrainerGroup(cfg.trainer, self.model_path, seed=cfg.seed, name_prefix=f"rayrl-{cfg.exp_id}",
                                    placement=self.placement)
        self.weight_transfer = resolve_weight_transfer(cfg.pipeline.weight_transfer, resolve_backend(cfg.engine),
                                                       cfg.placement.mode)
        if self.weight_transfer != "disk":
            self._open_weight_sender()
        self.ray_sink = RayMetricsSink(cfg.exp_id)
        self.metrics = MetricsLogger(cfg.logging, self.run_dir, extra_sink=self.ray_sink)
        self.schedule = cfg.pipeline.schedule
        if self.schedule == "colocated_async":
            self.trainer.offload()  # the engines hold the devices outside the train phase
        self.groups_in_flight = groups_in_flight(cfg)
        for warning in capacity_warnings(cfg):
            logger.warning(warning)
        self.dispatcher = GroupDispatcher(workers, cfg.rollout.group_size, self.groups_in_flight,
                                          self._restart_worker, cfg.pipeline.max_episode_retries)
        self.group_seq = 0  # groups ever queued; part of each group id
        self.worker_restarts = 0
        self._engine_check: Any = None  # (kind, ref) of a pending liveness check or restart
        self._devices_with_trainer = False  # colocated: the gateway holds calls during the train phase
        self._engine_checked_at = time.monotonic()
        self._episodes_total = 0
        self._engine_busy = CounterDeltas(time.monotonic())  # the engines' cumulative forward-pass seconds
        self._started_at = time.monotonic()

    @property
    def workers(self) -> list[Any]:
        """The live rollout workers (a dead one is replaced by the dispatcher)."""
        return self.dispatcher.workers

    def _restart_worker(self, index: int) -> Any:
        self.worker_restarts += 1
        cfg = self.cfg
        return RolloutWorker.options(
            name=f"rayrl-{cfg.exp_id}-rollout-{index}-r{self.worker_restarts}",
            max_concurrency=episodes_per_worker(cfg) + 1,
        ).remote(cfg, self.trajectories.handles, self.pool, index)

    # -- rollout -----------------------------------------------------------------------------------

    def _queue_new_groups(self, target: int) -> None:
        """Queue new tasks from the sampler until ``target`` groups are in flight."""
        while self.dispatcher.groups_in_flight < target:
            task = self.sampler.next(1)[0]
            self.group_seq += 1
            self.dispatcher.submit(task, f"g{self.group_seq:06d}-{task.task_id}")

    def _keep_going(self) -> None:
        """One turn of the dispatch loop while the driver waits on something else."""
        if self.schedule != "sync":
            self._queue_new_groups(self.groups_in_flight)
        self.dispatcher.poll(0.2, self.version)
        self._check_engines()

    def _check_engines(self) -> None:
        """Every second, look for engine processes that died. For one that did: hold the gateway's LLM
        calls (they wait instead of failing), restart it with the newest weights, let the calls go on.
        Generations running when it died are lost: their episodes are marked failed."""
        ref = self._engine_check
        if ref is None:
            if time.monotonic() - self._engine_checked_at > ENGINE_CHECK_INTERVAL_S:
                self._engine_checked_at = time.monotonic()
                self._engine_check = ("dead", self.engines.dead.remote())
            return
        kind, pending = ref
        if not ray.wait([pending], timeout=0)[0]:
            return
        self._engine_check = None
        try:
            result = ray.get(pending)
        except Exception as err:  # the restart itself failed: the run cannot generate any more
            self.failure_counts["engine_restart_failed"] += 1
            raise RuntimeError(f"restarting a dead engine failed: {err}") from None
        if kind == "dead" and result:
            logger.warning("engine(s) %s died; holding LLM calls at the gateway and restarting", result)
            ray.get([h.pause_generation.remote() for h in self.trajectories.handles])
            self._engine_check = ("restart", self.engines.restart_dead.remote(False))
        elif kind == "restart":
            if self.weight_transfer != "disk":  # the restarted engine is outside the group and has base weights
                self._open_weight_sender()
                self._push_weights()
            if self.schedule != "colocated_async" or not self._devices_with_trainer:
                ray.get([h.continue_generation.remote() for h in self.trajectories.handles])
            for url in result:
                self.failure_counts["engine_restarts"] += 1
                logger.warning("engine %s restarted with policy version %d", url, self.version)

    def _collect_groups(self, counts: dict[str, int]) -> list[Group]:
        """The step's ``prompts_per_step`` groups (sync: exactly the ones queued for it)."""
        cfg = self.cfg
        need = cfg.rollout.prompts_per_step
        sync = self.schedule == "sync"
        if sync:
            self._queue_new_groups(need)
        deadline = time.monotonic() + cfg.rollout.step_deadline_s if cfg.rollout.step_deadline_s > 0 else None
        enough = int(np.ceil(cfg.rollout.min_groups_fraction * need))
        taken: list[Group] = []
        with tqdm(total=need * cfg.rollout.group_size, desc=f"step {self.step} rollout", unit="ep", leave=False,
                  dynamic_ncols=True) as bar:
            while len(taken) < need:
                self._keep_going()
                done = self.dispatcher.take(need - len(taken))
                fresh, stale = (done, []) if sync else split_stale(done, self.version, cfg.pipeline.max_staleness)
                for group in stale:
                    counts["dropped_stale_groups"] += 1
                    counts["dropped_stale_samples"] += sum(len(e.samples) for e in group.episodes.values())
                    logger.info("group %s dropped: %d policy versions old", group.group_id,
                                group.staleness(self.version))
                    self.group_seq += 1  # the task runs again on newer weights: not lost, trained once
                    self.dispatcher.submit(group.task, f"g{self.group_seq:06d}-{group.task.task_id}", front=True)
                if fresh:
                    taken += fresh
                    bar.update(sum(g.size for g in fresh))
                past = deadline is not None and time.monotonic() > deadline
                if past and (sync or len(taken) >= enough):
                    break
        if sync and len(taken) < need:
            taken += self.dispatcher.fail_unfinished("step deadline reached")
        return taken

    def _trajectory_metrics(self) -> dict[str, float]:
        """Gateway and trajectory totals over all shards (cumulative since the run started)."""
        totals: dict[str, float] = defaultdict(float)
        for shard in self.trajectories.stats():
            for key, value in shard.items():
                if isinstance(value, (int, float)):
                    totals[key] += value
        keep = ("requests", "errors_4xx", "errors_engine", "tool_parse_errors", "cumulative_hits", "full_renders",
                "turns", "forks", "merged_rewrites")
        out = {f"gateway/{k}": totals[k] for k in keep if k in totals}
        out.update({f"trajectory/{k}": v for k, v in totals.items() if k.startswith("drift_")})
        # LLM calls held while generation was paused (colocated), continued after an abort, timed out
        out.update({f"gateway/{k[len('router_'):]}": v for k, v in totals.items()
                    if k in ("router_queued", "router_continued", "router_wait_timeouts", "router_retried",
                             "router_reconnect_waits")})
        return out

    def _write_episodes(self, episodes: list[Episode]) -> None:
        """One JSON line per episode (reward, status, answer, error, timings) under runs/<exp>/episodes/."""
        directory = self.run_dir / "episodes"
        directory.mkdir(exist_ok=True)
        with (directory / f"step{self.step:06d}.jsonl").open("w") as fh:
            for e in episodes:
                row = {"session_id": e.session_id, "task_id": e.task_id, "group_id": e.group_id,
                       "reward": e.reward, "status": e.status, "error": e.error, "samples": len(e.samples),
                       "generated_tokens": e.generated_tokens, **e.info, "timings": e.timings}
                fh.write(json.dumps(row) + "\n")

    def _log_failures(self, episodes: list[Episode]) -> None:
        for e in episodes:
            if not e.ok:
                kind = (e.error or "unknown").split(":")[0][:60]
                self.failure_counts[kind] += 1
                logger.warning("episode failed: session=%s task=%s: %s", e.session_id, e.task_id, e.error)

    def evaluate(self, step: int) -> dict[str, Any]:
        """One episode per validation task, at most ``pipeline.eval_max_concurrent`` in flight."""
        assert self.val_dataset is not None
        n = self.cfg.pipeline.eval_tasks or len(self.val_dataset)
        tasks = [self.val_dataset[i] for i in range(min(n, len(self.val_dataset)))]
        limit = self.cfg.pipeline.eval_max_concurrent
        episodes: list[Episode] = []
        in_flight: list[Any] = []
        k = 0
        started = time.monotonic()
        with tqdm(total=len(tasks), desc=f"eval @ step {step}", unit="ep", leave=False, dynamic_ncols=True) as bar:
            for i, task in enumerate(tasks):
                if len(in_flight) >= limit:
                    done, in_flight = ray.wait(in_flight, num_returns=1)
                    episodes.append(ray.get(done[0]))
                    bar.update(1)
                worker = self.workers[k % len(self.workers)]
                k += 1
                in_flight.append(worker.run_episode.remote(task, f"eval{step}-{i}", 0))
            for ref in in_flight:
                episodes.append(ray.get(ref))
                bar.update(1)
        metrics = {
            "eval/reward_mean": float(np.mean([e.reward for e in episodes])),
            "eval/success_rate": float(np.mean([e.reward >= 1.0 for e in episodes])),
            "eval/tool_call_rate": float(np.mean([e.info.get("tool_calls", 0) > 0 for e in episodes])),
            "eval/episodes_failed": sum(not e.ok for e in episodes),
            "eval/time_s": time.monotonic() - started,
        }
        print(f"eval @ step {step}: success {metrics['eval/success_rate']:.3f} | reward "
              f"{metrics['eval/reward_mean']:.3f} | tool calls {metrics['eval/tool_call_rate']:.2f} | "
              f"{len(episodes)} tasks", flush=True)
        return metrics

    # -- one step ----------------------------------------------------------------------------------

    def train_batch(self, episodes: list[Episode]) -> tuple[list[Sample], list[float]]:
        """Samples of successful episodes with their episode's GRPO advantage."""
        ok = [e for e in episodes if e.ok]
        adv = grpo_advantages([e.reward for e in ok], [e.group_id for e in ok], self.cfg.trainer.normalize_advantage_std)
        samples, advantages = [], []
        for e, a in zip(ok, adv):
            for s in e.samples:
                samples.append(s)
                advantages.append(float(a))
        return samples, advantages

    def run_step(self) -> dict[str, Any]:
        cfg = self.cfg
        self.step += 1
        t_step = time.monotonic()
        counts: dict[str, int] = defaultdict(int)
        groups = self._collect_groups(counts)
        self._untrained_taken = groups
        rollout_s = time.monotonic() - t_step
        episodes = [e for g in groups for e in g.ordered()]
        self._log_failures(episodes)
        self._write_episodes(episodes)
        samples, advantages = self.train_batch(episodes)
        ok = [e for e in episodes if e.ok]
        generated = sum(e.generated_tokens for e in episodes)
        staleness = [self.version - v for s in samples if (v := s.oldest_version()) is not None]
        self.ray_sink.staleness(staleness)
        metrics: dict[str, Any] = {
            "rollout/reward_mean": float(np.mean([e.reward for e in episodes])) if episodes else 0.0,
            "rollout/success_rate": float(np.mean([e.reward >= 1.0 for e in episodes])) if episodes else 0.0,
            "rollout/episodes": len(episodes),
            "rollout/episodes_ok": len(ok),
            "rollout/episodes_failed": len(episodes) - len(ok),
            "rollout/samples": len(samples),
            "rollout/generated_tokens": generated,
            "rollout/turns_mean": float(np.mean([e.info.get("turns", 0) for e in ok])) if ok else 0.0,
            "rollout/tool_calls_mean": float(np.mean([e.info.get("tool_calls", 0) for e in ok])) if ok else 0.0,
            "rollout/tool_errors_mean": float(np.mean([e.info.get("tool_errors", 0) for e in ok])) if ok else 0.0,
            "pipeline/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "pipeline/staleness_max": max(staleness, default=0),
            "pipeline/groups_in_flight": self.dispatcher.groups_in_flight,
            "time/rollout_s": rollout_s,
        }
        metrics.update({f"pipeline/{k}": v for k, v in counts.items()})
        if any(a != 0.0 for a in advantages):
            metrics.update(self._train_and_sync(samples, advantages))
        else:
            logger.info("step %d: every group had equal rewards; no gradient step", self.step)
            metrics["train/trained_samples"] = 0
        self._untrained_taken = []  # trained (or nothing to learn from: equal rewards in every group)
        metrics["train/policy_version"] = self.version
        metrics.update(self._trajectory_metrics())
        work = ray.get(self.engines.work_stats.remote())  # cumulative since the engines started
        metrics["engine/prompt_tokens"] = int(work["prompt_tokens"])
        metrics["engine/prefix_cache_hit_rate"] = work["cached_prompt_tokens"] / max(work["prompt_tokens"], 1)
        # since the last read: the step and whatever the engines did between steps
        busy, window = self._engine_busy.update({k: work[k] for k in ("prefill_s", "decode_s")}, time.monotonic())
        for kind, n in {**self.failure_counts, **self.dispatcher.counts}.items():
            metrics[f"failures/{kind}"] = n
        if (launcher := self._agentcore_launcher()) is not None:
            metrics.update({f"agentcore/{k}": v for k, v in ray.get(launcher.stats.remote()).items()})
        step_s = time.monotonic() - t_step
        self._episodes_total += len(episodes)
        metrics["time/step_s"] = step_s
        engines = max(len(self.engine_urls), 1)
        for kind, seconds in busy.items():  # forward-pass time per engine over the step: how busy they were
            metrics[f"engine/{kind}"] = seconds / engines
        metrics["engine/busy_fraction"] = sum(busy.values()) / engines / max(window, 1e-9)
        metrics["rollout/episodes_per_s"] = len(episodes) / max(step_s, 1e-9)
        metrics["rollout/generated_tokens_per_s"] = generated / max(step_s, 1e-9)
        metrics["rollout/episodes_per_s_run"] = self._episodes_total / max(time.monotonic() - self._started_at, 1e-9)
        self.metrics.log(self.step, metrics)
        print(summary_line(self.step, cfg.trainer.steps, metrics)
              + f" | episodes {len(episodes)} | staleness {metrics['pipeline/staleness_mean']:.2f}"
              + f" | dropped {counts['dropped_stale_groups']}", flush=True)
        return metrics

    # -- the train phase, by schedule ---------------------------------------------------------------

    def _train_and_sync(self, samples: list[Sample], advantages: list[float]) -> dict[str, Any]:
        """Train, then put the new weights on the engines, with the schedule's phases around both."""
        metrics: dict[str, Any] = {}
        colocated = self.schedule == "colocated_async"
        t0 = time.monotonic()
        if colocated:
            self._give_devices_to_trainer()
            metrics["time/engine_pause_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        if colocated:
            self.trainer.onload()
        train = self._while_dispatching(lambda: self.trainer.train(samples, advantages))
        if colocated:
            self.trainer.offload()
        metrics["time/train_s"] = time.monotonic() - t1
        metrics.update({f"train/{k}": v for k, v in train.items()})
        self.version = int(train["policy_version"])
        t2 = time.monotonic()
        if colocated:
            metrics["gateway/queue_depth"] = sum(s.get("router_queue_depth", 0) for s in self.trajectories.stats())
            ray.get(self.engines.resume_memory_occupation.remote())
        self._push_weights()
        if colocated:
            ray.get(self.engines.continue_generation.remote())
            ray.get([h.continue_generation.remote() for h in self.trajectories.handles])
            self._devices_with_trainer = False
        metrics["time/weight_sync_s"] = time.monotonic() - t2
        return metrics

    def _give_devices_to_trainer(self) -> None:
        """Hold LLM calls at the gateway, stop (or finish) generation, free the engines' memory."""
        self._devices_with_trainer = True
        ray.get([h.pause_generation.remote() for h in self.trajectories.handles])
        if self.cfg.pipeline.partial_rollout:
            mode = "abort"  # the gateway continues each aborted generation after the update
        else:
            mode = "in_place"  # nothing is running once the gateway drained
            drained = self._while_dispatching(lambda: all(ray.get(
                [h.drain.remote(self.cfg.pipeline.generation_wait_timeout_s) for h in self.trajectories.handles])))
            if not drained:
                logger.warning("generations still running at the weight update after %.0f s; aborting them",
                               self.cfg.pipeline.generation_wait_timeout_s)
                self.failure_counts["drain_timeouts"] += 1
                mode = "abort"
        ray.get(self.engines.pause_generation.remote(mode))
        ray.get(self.engines.release_memory_occupation.remote())

    def _while_dispatching(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a blocking call to the trainer or the gateway) while episodes keep being
        dispatched and collected; the sync schedule has nothing running, so it just calls ``fn``."""
        if self.schedule == "sync":
            return fn()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-phase") as pool:
            future = pool.submit(fn)
            while not future.done():
                self._keep_going()
            return future.result()

    def _open_weight_sender(self) -> None:
        self.trainer.open_weight_sender(self.weight_transfer, self.engine_urls, self.cfg.engine.tp_size,
                                        self.cfg.pipeline.weight_sync_timeout_s)

    def _push_weights(self) -> None:
        """Send the trainer's weights to every engine (``pipeline.weight_transfer``), bounded by
        ``pipeline.weight_sync_timeout_s``: a hung engine fails the run with a clear error."""
        timeout = self.cfg.pipeline.weight_sync_timeout_s
        if self.weight_transfer == "disk":
            path = self.trainer.export_weights(str(self.weights_root), self.version, self.cfg.engine.dtype)
            refs = [self.engines.update_weights_from_disk.remote(path, str(self.version), timeout)]
        else:
            refs = self.trainer.push_weights(self.version, self.cfg.engine.dtype)
        try:
            ray.get(refs, timeout=timeout + 30)
        except Exception as err:
            self.failure_counts["weight_sync_failed"] += 1
            detail = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            message = (f"weight update to the engines (policy version {self.version}, {self.weight_transfer}) "
                       f"failed or did not finish "
                       f"within pipeline.weight_sync_timeout_s={timeout:g} s: {detail}")
            logger.error(message)
            raise WeightSyncError(message) from None

    # -- the run -----------------------------------------------------------------------------------

    def save_checkpoint(self, only_rank0: bool = False) -> str:
        """Trainer and optimizer state with each rank's RNG, the data cursor, step, policy version and
        the schedule's untrained groups, to ``pipeline.checkpoint_dir`` (a directory or s3://).

        ``pipeline.json`` is written (or uploaded) last: a save cut short, even by SIGKILL, is ignored.
        """
        directory = self.checkpoints.staging_dir(self.step)
        self.trainer.save_checkpoint(str(directory), only_rank0=only_rank0)
        state = {
            "step": self.step,
            "policy_version": self.version,
            "sampler": self.sampler.state_dict(),
            "schedule": self.schedule_state(),
        }
        where = self.checkpoints.commit(self.step, state)
        print(f"[rayrl] checkpoint: {where}", flush=True)
        return where

    def schedule_state(self) -> dict[str, Any]:
        """What the schedule needs to resume exactly: every group taken for a step that has not trained
        yet, then every group queued, running or complete (the sampler's cursor is already past their
        tasks), in order, and the group counter. On resume those tasks run again first, so none is
        skipped and none is trained twice."""
        taken = [{"task": dataclasses.asdict(g.task), "group_id": g.group_id} for g in self._untrained_taken]
        return {"schedule": self.schedule, "group_seq": self.group_seq,
                "untrained_groups": taken + self.dispatcher.untrained_tasks()}

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        """Queue the checkpoint's untrained groups again (fresh episodes: those in flight were lost)."""
        self.group_seq = int(state.get("group_seq", self.group_seq))
        for row in state.get("untrained_groups", []):
            self.dispatcher.submit(GroupDispatcher.task_of(row), row["group_id"])

    def latest_checkpoint(self) -> str | None:
        """Where the newest complete checkpoint lives, or None."""
        step = self.checkpoints.latest()
        return None if step is None else self.checkpoints.location_of(step)

    def resume(self) -> bool:
        """Continue from the newest complete checkpoint: the next step takes exactly the next tasks."""
        step = self.checkpoints.latest()
        if step is None:
            print(f"[rayrl] no checkpoint at {self.checkpoints.location}; starting fresh", flush=True)
            return False
        directory, state = self.checkpoints.fetch(step)
        self.version = self.trainer.load_checkpoint(str(directory))
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.load_schedule_state(state.get("schedule") or {})
        if self.version > 0:
            self._push_weights()
        print(f"[rayrl] resumed from {self.checkpoints.location_of(step)} at step {self.step}, "
              f"policy version {self.version}", flush=True)
        return True

    def _stop_on_trainer_failure(self, failure: TrainerFailure) -> None:
        """A trainer rank died: leave a checkpoint that resumes exactly, and say how to resume.

        Rank 0 that did not step holds the weights from before this step (the same state as after the
        previous step), so the newest checkpoint, or a new one of the previous step with this step's groups
        marked untrained, resumes exactly. Rank 0 that stepped holds this step's result: it is saved as
        this step. Rank 0 gone: the newest checkpoint is the way back.
        """
        self.failure_counts["trainer_rank_failures"] += 1
        where = None
        if failure.rank0_alive and failure.rank0_stepped:
            self.version += 1
            self._untrained_taken = []
            where = self.save_checkpoint(only_rank0=True)
        elif failure.rank0_alive:
            self.step -= 1
            existing = self.checkpoints.latest()
            where = (self.checkpoints.location_of(existing) if existing == self.step
                     else self.save_checkpoint(only_rank0=True))
        else:
            where = self.latest_checkpoint()
        resume = (f"python driver.py --config {self.run_dir / 'config.yaml'} --resume" if where
                  else "no checkpoint exists: start the run again")
        message = f"{failure}. Checkpoint: {where or 'none'}. Resume with: {resume}"
        logger.error(message)
        print(f"[rayrl] run stopped: {message}", flush=True)

    def run(self) -> list[dict[str, Any]]:
        history = []
        total = self.cfg.trainer.steps
        eval_every = self.cfg.pipeline.eval_interval
        if eval_every and self.step == 0:
            self.metrics.log(0, self.evaluate(0))
        while self.step < total:
            try:
                history.append(self.run_step())
            except TrainerFailure as failure:
                self._stop_on_trainer_failure(failure)
                raise
            interval = self.cfg.pipeline.checkpoint_interval
            if interval and self.step % interval == 0:
                self.save_checkpoint()
            if eval_every and (self.step % eval_every == 0 or self.step == total):
                self.metrics.log(self.step, self.evaluate(self.step))
        if history and not (self.cfg.pipeline.checkpoint_interval and self.step % self.cfg.pipeline.checkpoint_interval == 0):
            self.save_checkpoint()
        if failures := dict(self.failure_counts):
            print(f"[rayrl] failed episodes by cause: {failures}", flush=True)
        print(f"[rayrl] metrics: {self.metrics.jsonl_path}  reward curve: {self.run_dir / 'reward_curve.png'}", flush=True)
        return history

    def _agentcore_launcher(self) -> Any:
        """The run's AgentCore launcher actor (created by the first rollout worker that needs it), if any."""
        if self.cfg.rollout.agent != "agentcore":
            return None
        try:
            return ray.get_actor(f"rayrl-{self.cfg.exp_id}-agentcore-launcher")
        except ValueError:
            return None

    def shutdown(self) -> None:
        """Stop every actor gracefully, then release it (names become free for the next pipeline)."""
        self.metrics.close()
        if self.weight_transfer != "disk":  # leave the engines' broadcast group before they stop
            try:
                self.trainer.close_weight_sender()
            except Exception as err:  # a dead trainer rank or engine: nothing left to close politely
                logger.warning("closing the weight sender: %s", err)
        graceful = [h.shutdown.remote() for h in self.trajectories.handles]
        graceful += [self.engines.shutdown.remote(), self.pool.shutdown.remote()]
        launcher = self._agentcore_launcher()
        if launcher is not None:  # stops its local agent, emulator and S3 processes politely
            graceful.append(launcher.shutdown.remote())
        try:
            ray.get(graceful, timeout=60)
        except Exception as err:  # an actor that already died cannot be stopped politely
            logger.warning("graceful shutdown incomplete: %s", err)
        for ref in self.dispatcher.running:  # episodes of groups the run did not need
            ray.cancel(ref)
        for handle in [*self.trajectories.handles, *self.workers, self.engines, self.pool,
                       *([launcher] if launcher is not None else [])]:
            ray.kill(handle)
        self.trainer.shutdown()
        if self.placement is not None:
            self.placement.remove()
