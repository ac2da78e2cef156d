"""Connecting the driver to Ray: join the job's cluster, or start a local one that is safe by default.

Ray's own defaults for a local cluster are not what a shared GPU node wants: its gRPC ports listen on
every interface, so the local cluster this driver starts always has token authentication on (every
gRPC call, the dashboard API and ``ray job submit`` need the token in ``~/.ray/auth_token``) and its
dashboard listens on loopback only. Reach it from a laptop with an SSH tunnel
(``ssh -L 8265:127.0.0.1:8265 node``) and pass the token (``ray get-auth-token``) as a bearer header or
the ``ray-authentication-token`` cookie.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayrl.config import RayConfig
from rayrl.ports import free_port

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def on_driver_node() -> dict[str, Any]:
    """``.options(**...)`` that pin an actor to the driver's node: the gateway, the sandbox pool and the
    rollout workers stay together there (a local sandbox is a process tree on the pool's node, used
    directly by the worker that leased it), wherever the engines and trainer ranks are."""
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def init_ray(cfg: RayConfig) -> Any:
    """``ray.init`` for this run.

    Under ``ray job submit`` (RAY_ADDRESS set by Ray) or with ``ray.address`` the driver joins that
    cluster. Otherwise it starts a local Ray with token authentication and a loopback dashboard, a new one
    (``address="local"``): a bare ``ray.init`` would instead join whatever cluster Ray's temp dir last
    recorded (``/tmp/ray/ray_current_cluster``, left behind by a ``ray start`` that may be long dead) and
    then refuse the local cluster's resources with a traceback.
    driver.py sets ``RAY_AUTH_MODE=token`` before Ray is imported (Ray reads it at import); in a
    notebook, Ray's own default for a local ``ray.init`` turns it on (tests/ops checks both).
    """
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        return ray.init(address=address, log_to_driver=True)
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        logger.warning("%s=%s: the local Ray cluster starts WITHOUT authentication; its ports listen on "
                       "every interface. Use this only on a machine nobody else can reach.", AUTH_MODE_ENV, mode)
    num_cpus = cfg.num_cpus or max(4, os.cpu_count() or 1)
    return ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=cfg.num_gpus,
        include_dashboard=cfg.include_dashboard,
        dashboard_host=cfg.dashboard_host,
        dashboard_port=free_dashboard_port(cfg.dashboard_host, cfg.dashboard_port) if cfg.include_dashboard else
        cfg.dashboard_port,
        log_to_driver=True,
    )


def free_dashboard_port(host: str, port: int) -> int:
    """``port`` when nothing listens on it, else a free port, said in one warning: a second run on the same
    machine (another local Ray's dashboard holds 8265) starts, where Ray itself would stop with a traceback."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is not "in use"
        try:
            probe.bind((host, port))
            return port
        except OSError:
            pass
    free = free_port(host)
    logger.warning("ray.dashboard_port %d on %s is in use (another Ray's dashboard?): this run's dashboard is on "
                   "port %d (set ray.dashboard_port to choose one)", port, host, free)
    return free
