"""The pipeline: wires engines, trajectory managers, sandbox pool, rollout workers and trainer.

The order of phases lives here and nowhere else. The ``sync`` schedule, one step:

1. sample ``prompts_per_step`` tasks; run ``group_size`` episodes of each on the rollout workers;
2. GRPO advantages per group over the episodes that succeeded (failed ones are counted, logged once,
   and excluded);
3. one trainer step;
4. new weights to every engine with the next policy version;
5. metrics, summary line, checkpoint when due.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import ray
from tqdm import tqdm

from actors.engine import EngineGroup
from actors.rollout_worker import start_workers
from actors.sandbox_pool import SandboxPoolActor
from actors.trainer import TrainerGroup
from actors.trajectory_manager import TrajectoryManagers, start_trajectory_managers
from rayrl.config import RunConfig, to_yaml
from rayrl.data import JsonlDataset, TaskSampler
from rayrl.metrics import MetricsLogger, summary_line
from rayrl.models import resolve_model_path
from rayrl.trainers.losses import grpo_advantages
from rayrl.trainers.weights import shared_memory_root
from rayrl.types import Episode, Sample, Task

logger = logging.getLogger("rayrl.pipeline")


class RayMetricsSink:
    """Step metrics as Ray gauges, visible in the Ray dashboard's Metrics view."""

    def __init__(self, exp_id: str) -> None:
        from ray.util.metrics import Gauge

        self._gauge = Gauge("rayrl_step_metric", "rayrl per-step metrics", tag_keys=("exp_id", "metric"))
        self.exp_id = exp_id

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            self._gauge.set(float(value), tags={"exp_id": self.exp_id, "metric": key})


class Pipeline:
    """Builds every actor from one RunConfig and runs the training loop."""

    def __init__(self, cfg: RunConfig) -> None:
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
        self.step = 0
        self.version = 0

        log_dir = str((self.run_dir / "logs").resolve())
        print("[rayrl] starting engines...", flush=True)
        self.engines = EngineGroup.options(name=f"rayrl-{cfg.exp_id}-engines").remote(
            cfg.engine, self.model_path, log_dir
        )
        self.engine_urls = ray.get(self.engines.urls.remote())
        print("[rayrl] starting trajectory managers, sandbox pool, rollout workers and trainer...", flush=True)
        self.trajectories: TrajectoryManagers = start_trajectory_managers(cfg, self.model_path, self.engine_urls)
        self.pool = SandboxPoolActor.options(name=f"rayrl-{cfg.exp_id}-sandbox-pool").remote(
            cfg.sandbox, cfg.sandbox_pool
        )
        self.workers = start_workers(cfg, self.trajectories.handles, self.pool)
        self.trainer = TrainerGroup(cfg.trainer, self.model_path, seed=cfg.seed, name_prefix=f"rayrl-{cfg.exp_id}")
        self.metrics = MetricsLogger(cfg.logging, self.run_dir, extra_sink=RayMetricsSink(cfg.exp_id))

    # -- rollout -----------------------------------------------------------------------------------

    def _run_episodes(self, tasks: list[Task], step: int) -> list[Episode]:
        """All episodes of one step, with a progress bar; a deadline fails what is still running."""
        cfg = self.cfg.rollout
        pending: dict[Any, tuple[Task, str, int]] = {}
        k = 0
        for t_index, task in enumerate(tasks):
            group_id = f"step{step}-task{t_index}-{task.task_id}"
            for i in range(cfg.group_size):
                worker = self.workers[k % len(self.workers)]
                k += 1
                pending[worker.run_episode.remote(task, group_id, i)] = (task, group_id, i)
        episodes: list[Episode] = []
        deadline = time.monotonic() + cfg.step_deadline_s if cfg.step_deadline_s > 0 else None
        needed = int(np.ceil(cfg.min_groups_fraction * len(tasks)))
        done_groups: dict[str, int] = defaultdict(int)
        with tqdm(total=len(pending), desc=f"step {step} rollout", unit="ep", leave=False, dynamic_ncols=True) as bar:
            while pending:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
                if not ready:
                    break
                ref = ready[0]
                task, group_id, i = pending.pop(ref)
                try:
                    episode = ray.get(ref)
                except Exception as err:  # the worker itself died: the episode fails, the step goes on
                    episode = Episode(session_id="", task_id=task.task_id, group_id=group_id, status="failed",
                                      error=f"rollout worker failed: {type(err).__name__}: {err}")
                episodes.append(episode)
                bar.update(1)
                bar.set_postfix(ok=sum(e.ok for e in episodes), failed=sum(not e.ok for e in episodes))
                done_groups[group_id] += 1
                complete = sum(1 for n in done_groups.values() if n == cfg.group_size)
                if deadline is not None and complete >= needed and time.monotonic() > deadline:
                    break
        for ref, (task, group_id, _) in pending.items():
            ray.cancel(ref)
            episodes.append(Episode(session_id="", task_id=task.task_id, group_id=group_id, status="failed",
                                    error="step deadline reached"))
        return episodes

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
        tasks = self.sampler.next(cfg.rollout.prompts_per_step)
        t0 = time.monotonic()
        episodes = self._run_episodes(tasks, self.step)
        rollout_s = time.monotonic() - t0
        self._log_failures(episodes)
        self._write_episodes(episodes)
        samples, advantages = self.train_batch(episodes)
        ok = [e for e in episodes if e.ok]
        generated = sum(e.generated_tokens for e in episodes)
        metrics: dict[str, Any] = {
            "rollout/reward_mean": float(np.mean([e.reward for e in episodes])) if episodes else 0.0,
            "rollout/success_rate": float(np.mean([e.reward >= 1.0 for e in episodes])) if episodes else 0.0,
            "rollout/episodes_ok": len(ok),
            "rollout/episodes_failed": len(episodes) - len(ok),
            "rollout/samples": len(samples),
            "rollout/generated_tokens": generated,
            "rollout/generated_tokens_per_s": generated / max(rollout_s, 1e-9),
            "rollout/turns_mean": float(np.mean([e.info.get("turns", 0) for e in ok])) if ok else 0.0,
            "rollout/tool_calls_mean": float(np.mean([e.info.get("tool_calls", 0) for e in ok])) if ok else 0.0,
            "rollout/tool_errors_mean": float(np.mean([e.info.get("tool_errors", 0) for e in ok])) if ok else 0.0,
            "time/rollout_s": rollout_s,
        }
        if any(a != 0.0 for a in advantages):
            t0 = time.monotonic()
            train = self.trainer.train(samples, advantages)
            metrics["time/train_s"] = time.monotonic() - t0
            metrics.update({f"train/{k}": v for k, v in train.items()})
            t0 = time.monotonic()
            self.version = int(train["policy_version"])
            path = self.trainer.export_weights(str(self.weights_root), self.version, cfg.engine.dtype)
            ray.get(self.engines.update_weights_from_disk.remote(path, str(self.version)))
            metrics["time/weight_sync_s"] = time.monotonic() - t0
        else:
            logger.info("step %d: every group had equal rewards; no gradient step", self.step)
            metrics["train/trained_samples"] = 0
        metrics["train/policy_version"] = self.version
        metrics.update(self._trajectory_metrics())
        metrics["time/step_s"] = time.monotonic() - t_step
        self.metrics.log(self.step, metrics)
        print(summary_line(self.step, cfg.trainer.steps, metrics), flush=True)
        return metrics

    # -- the run -----------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.cfg.pipeline.checkpoint_dir or self.run_dir / "checkpoints")

    def save_checkpoint(self) -> Path:
        """Trainer and optimizer state with each rank's RNG, the data cursor, step and policy version.

        ``pipeline.json`` is written last: a directory without it is an interrupted save and is ignored.
        """
        directory = self.checkpoint_root / f"step{self.step:06d}"
        self.trainer.save_checkpoint(str(directory))
        state = {
            "step": self.step,
            "policy_version": self.version,
            "sampler": self.sampler.state_dict(),
        }
        tmp = directory / "pipeline.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(directory / "pipeline.json")
        print(f"[rayrl] checkpoint: {directory}", flush=True)
        return directory

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p.parent for p in self.checkpoint_root.glob("step*/pipeline.json"))
        return done[-1] if done else None

    def resume(self) -> bool:
        """Continue from the newest complete checkpoint: the next step takes exactly the next tasks."""
        directory = self.latest_checkpoint()
        if directory is None:
            print(f"[rayrl] no checkpoint under {self.checkpoint_root}; starting fresh", flush=True)
            return False
        state = json.loads((directory / "pipeline.json").read_text())
        self.version = self.trainer.load_checkpoint(str(directory))
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        if self.version > 0:
            path = self.trainer.export_weights(str(self.weights_root), self.version, self.cfg.engine.dtype)
            ray.get(self.engines.update_weights_from_disk.remote(path, str(self.version)))
        print(f"[rayrl] resumed from {directory} at step {self.step}, policy version {self.version}", flush=True)
        return True

    def run(self) -> list[dict[str, Any]]:
        history = []
        total = self.cfg.trainer.steps
        eval_every = self.cfg.pipeline.eval_interval
        if eval_every and self.step == 0:
            self.metrics.log(0, self.evaluate(0))
        while self.step < total:
            history.append(self.run_step())
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

    def shutdown(self) -> None:
        """Stop every actor gracefully, then release it (names become free for the next pipeline)."""
        self.metrics.close()
        graceful = [h.shutdown.remote() for h in self.trajectories.handles]
        graceful += [self.engines.shutdown.remote(), self.pool.shutdown.remote()]
        try:
            ray.get(graceful, timeout=60)
        except Exception as err:  # an actor that already died cannot be stopped politely
            logger.warning("graceful shutdown incomplete: %s", err)
        for handle in [*self.trajectories.handles, *self.workers, self.engines, self.pool]:
            ray.kill(handle)
        self.trainer.shutdown()
