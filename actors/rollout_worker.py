"""RolloutWorker: a Ray actor that runs episodes (harness + sandbox lease + reward -> Episode)."""

from __future__ import annotations

import logging
from typing import Any

import ray

from actors.gateway_shard import GatewayShards
from actors.runtime import on_driver_node
from rayrl.agents import agent_factory, harness_row
from rayrl.agents.episode import EpisodeRunner
from rayrl.config import RunConfig
from rayrl.rewards import reward_fn_for
from rayrl.sandboxes import open_sandbox
from rayrl.sandboxes.base import Sandbox
from rayrl.types import Episode, Task


class _PoolSandboxes:
    """SandboxService over the SandboxPool actor; the sandbox itself is used from this process."""

    def __init__(self, pool: Any, owner: str, lease_s: float, timeout_s: float) -> None:
        self.pool = pool
        self.owner = owner
        self.lease_s = lease_s
        self.timeout_s = timeout_s

    def acquire(self) -> tuple[str, Sandbox]:
        lease = ray.get(self.pool.acquire.remote(self.owner, self.lease_s, self.timeout_s))
        return lease.lease_id, open_sandbox(lease.handle)

    def release(self, lease_id: str) -> None:
        ray.get(self.pool.release.remote(lease_id))


class _TreeKeepingShards(GatewayShards):
    """The runner's session service: finishing a session also fetches its turn tree for the run records
    (rayrl/records.py), kept here until ``run_episode`` puts it on its Episode (``Episode.tree``)."""

    def __init__(self, handles: list[Any]) -> None:
        super().__init__(handles)
        self.trees: dict[str, dict[str, Any] | None] = {}

    def finish_session(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list:
        samples, self.trees[session_id] = self.finish_session_with_tree(session_id, reward, metadata)
        return samples


@ray.remote(num_cpus=0)
class RolloutWorker:
    """Runs episodes concurrently, one per Ray actor thread.

    A threaded actor (``max_concurrency`` = ``rollout.max_concurrent_episodes``, resolved by
    ``rayrl.resolve`` and set by ``start_workers``)
    rather than an async one: agents are blocking code (the openai SDK, subprocesses), so each episode
    owns a thread and Ray bounds how many run at once.
    """

    def __init__(self, cfg: RunConfig, shard_handles: list[Any], pool: Any, worker_index: int = 0) -> None:
        logging.basicConfig(level=cfg.logging.log_level)
        quiet_http_loggers()
        owner = ray.get_runtime_context().get_actor_id()
        row = harness_row(cfg.rollout.agent)
        if row is not None and row.run_launcher:  # wired to the run's one launcher (actors/agentcore_launcher.py)
            from actors.agentcore_launcher import agentcore_harness

            harness = agentcore_harness(cfg)
        else:  # checked when the config was loaded (rayrl/preflight.py)
            harness = agent_factory(cfg.rollout)()
        self.sessions = _TreeKeepingShards(shard_handles)
        self.runner = EpisodeRunner(
            harness=harness,
            reward_fn=reward_fn_for(cfg.rollout),
            sessions=self.sessions,
            sandboxes=_PoolSandboxes(pool, owner, cfg.sandbox_pool.lease_s, cfg.sandbox_pool.acquire_timeout_s)
            if harness.needs_sandbox else None,
            cfg=cfg.rollout,
            model_name=cfg.model.path,
        )
        self.index = worker_index

    def run_episode(self, task: Task, group_id: str, index: int = 0) -> Episode:
        episode = self.runner.run(task, group_id, index)
        episode.tree = self.sessions.trees.pop(episode.session_id, None)
        return episode

    def ping(self) -> int:
        return self.index


def quiet_http_loggers() -> None:
    """HTTP client libraries log every request at INFO; we log only unusual requests."""
    for name in ("httpx", "httpx2", "httpcore", "openai", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def start_workers(cfg: RunConfig, shard_handles: list[Any], pool: Any) -> list[Any]:
    workers = [
        RolloutWorker.options(
            name=f"rayrl-{cfg.exp_id}-rollout-{i}", max_concurrency=cfg.rollout.max_concurrent_episodes + 1,
            **on_driver_node(),
        ).remote(cfg, shard_handles, pool, i)
        for i in range(cfg.rollout.num_workers)
    ]
    ray.get([w.ping.remote() for w in workers])
    return workers
