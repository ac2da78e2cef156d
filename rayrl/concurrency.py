"""How much of a run is in flight at once: task groups ahead of training, episodes per rollout worker.

Both follow from the schedule. ``sync`` runs exactly one step's groups. The async schedules keep as many
batches going as the staleness bound lets train: (``max_staleness`` + 1) × ``prompts_per_step`` groups
unless ``pipeline.groups_in_flight`` says otherwise. Episodes per worker default to enough threads for
every episode of those groups: a group counted as in flight but waiting for a worker thread ages
against ``max_staleness`` without making progress, and the step after it waits for it.
"""

from __future__ import annotations

import dataclasses
import math

from rayrl.config import RunConfig


def groups_in_flight(cfg: RunConfig) -> int:
    """Task groups queued, running or complete-but-untrained that the schedule keeps at once."""
    per_step = cfg.rollout.prompts_per_step
    if cfg.pipeline.schedule == "sync":
        return per_step
    return cfg.pipeline.groups_in_flight or (cfg.pipeline.max_staleness + 1) * per_step


def episodes_per_worker(cfg: RunConfig) -> int:
    """``rollout.max_concurrent_episodes``, with 0 resolved to this schedule's episodes in flight, plus
    validation's ``pipeline.eval_max_concurrent`` when validation is on (its episodes can start while
    the last training groups still run), spread over ``rollout.num_workers``."""
    if cfg.rollout.max_concurrent_episodes > 0:
        return cfg.rollout.max_concurrent_episodes
    episodes = groups_in_flight(cfg) * cfg.rollout.group_size
    if cfg.pipeline.eval_interval > 0:
        episodes += cfg.pipeline.eval_max_concurrent
    return max(1, math.ceil(episodes / cfg.rollout.num_workers))


def with_rollout_concurrency(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``rollout.max_concurrent_episodes`` (and, in the async schedules,
    ``pipeline.groups_in_flight``) resolved, as the run's config.yaml records them; ``cfg`` is not changed."""
    rollout = dataclasses.replace(cfg.rollout, max_concurrent_episodes=episodes_per_worker(cfg))
    pipeline = cfg.pipeline
    if pipeline.schedule != "sync":
        pipeline = dataclasses.replace(pipeline, groups_in_flight=groups_in_flight(cfg))
    return dataclasses.replace(cfg, rollout=rollout, pipeline=pipeline)


def capacity_warnings(cfg: RunConfig) -> list[str]:
    """What makes some episodes of the groups in flight wait, when explicit limits are below them."""
    episodes = groups_in_flight(cfg) * cfg.rollout.group_size
    slots = cfg.rollout.num_workers * episodes_per_worker(cfg)
    warnings = []
    if slots < episodes:
        warnings.append(f"rollout.max_concurrent_episodes={episodes_per_worker(cfg)} x {cfg.rollout.num_workers} "
                        f"workers run fewer episodes than the {groups_in_flight(cfg)} groups in flight hold "
                        f"({episodes}): the rest wait for a worker thread")
    if cfg.rollout.agent != "agentcore" and cfg.sandbox_pool.max_size < min(slots, episodes):
        warnings.append(f"sandbox_pool.max_size={cfg.sandbox_pool.max_size} is below the {min(slots, episodes)} "
                        "episodes in flight: the rest wait for a sandbox (up to sandbox_pool.acquire_timeout_s)")
    return warnings
