"""AgentCoreLauncher: the run's one RolloutLauncher, shared by every rollout worker.

AgentCore's invoke quota (``agentcore.acr_tps_limit``) and the session bound
(``agentcore.max_concurrent``) are global to a run, so one actor owns the limiter, the semaphore and
the boto3 connection pool; rollout workers call it (``LauncherClient``). Dividing the limits among
workers instead would strand capacity whenever workers are unevenly busy. In local mode the actor also
owns the local stack (agent app, FAKE runtime, moto S3): its children die with it.

The actor is created by the first rollout worker that needs it (named, ``get_if_exists``), so the
pipeline needs no change; it is owned by that worker and ends when the workers are killed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray

from rayrl.agents import make_harness
from rayrl.agents.agentcore.launcher import RolloutLauncher, SessionOutcome
from rayrl.agents.base import BaseHarness
from rayrl.config import AgentCoreConfig, RunConfig


@ray.remote(num_cpus=0)
class AgentCoreLauncher:
    """A threaded actor: each ``run_session`` blocks one thread for its session (mostly polling S3)."""

    def __init__(self, cfg: RunConfig) -> None:
        logging.basicConfig(level=cfg.logging.log_level)
        for name in ("botocore", "boto3", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.local = None
        settings, credentials = cfg.agentcore, None
        if settings.local_agent_command:
            from rayrl.agents.agentcore.local import LocalAgentCore

            self.local = LocalAgentCore(settings, Path(cfg.run_dir / "logs").resolve())
            settings, credentials = self.local.start()
        self.settings_ = settings
        self.launcher = RolloutLauncher(settings, credentials=credentials)

    def settings(self) -> AgentCoreConfig:
        """The resolved settings (local mode fills in endpoints, ARN and bucket)."""
        return self.settings_

    def run_session(self, payload: dict[str, Any], session_id: str, bucket: str, key: str,
                    budget_s: float | None = None) -> SessionOutcome:
        return self.launcher.run_session(payload, session_id, bucket, key, budget_s)

    def stats(self) -> dict[str, int]:
        return self.launcher.stats()

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.stop()


class LauncherClient:
    """The harness's SessionLauncher over the shared actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def run_session(self, payload: dict[str, Any], session_id: str, bucket: str, key: str,
                    budget_s: float | None = None) -> SessionOutcome:
        return ray.get(self.handle.run_session.remote(payload, session_id, bucket, key, budget_s))


def get_launcher(cfg: RunConfig) -> Any:
    """The run's launcher actor, created on first use; enough threads for every episode slot."""
    threads = cfg.rollout.num_workers * (cfg.rollout.max_concurrent_episodes + 1) + 4
    return AgentCoreLauncher.options(
        name=f"rayrl-{cfg.exp_id}-agentcore-launcher", get_if_exists=True, max_concurrency=threads
    ).remote(cfg)


def agentcore_harness(cfg: RunConfig) -> BaseHarness:
    """The ``agentcore`` harness of a rollout worker, wired to the run's launcher."""
    handle = get_launcher(cfg)
    settings = ray.get(handle.settings.remote())
    return make_harness("agentcore", launcher=LauncherClient(handle), cfg=settings, exp_id=cfg.exp_id)
