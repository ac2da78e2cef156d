"""Connecting the driver to Ray: join the job's cluster, or start a local one bound to loopback."""

from __future__ import annotations

import os
from typing import Any

import ray

from rayrl.config import RayConfig


def init_ray(cfg: RayConfig) -> Any:
    """``ray.init`` for this run.

    Under ``ray job submit`` (RAY_ADDRESS set by Ray) or with ``ray.address`` the driver joins that
    cluster. Otherwise it starts a local Ray whose dashboard listens on loopback only.
    """
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        return ray.init(address=address, log_to_driver=True)
    num_cpus = cfg.num_cpus or max(4, os.cpu_count() or 1)
    return ray.init(
        num_cpus=num_cpus,
        num_gpus=cfg.num_gpus,
        include_dashboard=cfg.include_dashboard,
        dashboard_host=cfg.dashboard_host,
        dashboard_port=cfg.dashboard_port,
        log_to_driver=True,
    )
