"""Where a stuck trainer rank waited: its process writes every thread's Python stack to its Ray log on demand.

A rank that gives no answer within the grace after a peer failed is killed (actors/trainer.py,
``TrainerGroup.gather``); just before that, the group asks its process for its stacks, so the stop line can
say where they are and the log shows where the rank waited (a collective, a store wait, its own code).
The process writes them from a signal handler (``faulthandler``: no GIL, no event loop needed) to its
stderr, which Ray keeps as the worker's ``.err`` log and prints on the driver's console. The signal is sent
by a zero-CPU task placed on the rank's node, so it works for ranks on any node of the cluster.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger("rayrl.trainer")

STACKS_SIGNAL = getattr(signal, "SIGUSR2", None)


def answer_stacks_signal() -> None:
    """In a rank's process: write every thread's stack to stderr on :data:`STACKS_SIGNAL`."""
    if STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, all_threads=True)


@ray.remote(num_cpus=0)
def _signal_stacks(pid: int) -> bool:
    """Ask process ``pid`` (on the node this task was placed on) to write its stacks; False if it is gone."""
    try:
        os.kill(pid, STACKS_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    time.sleep(0.5)  # faulthandler writes from the signal handler itself: give it time before the kill
    return True


def stacks_to_log(node_id: str | None, pid: int | None, timeout_s: float = 15.0) -> str:
    """Have process ``pid`` on node ``node_id`` write its stacks to its log; returns what to add to the
    rank's error (where the stacks are, or that they are unknown: its node is gone too, or it never set up)."""
    if node_id is None or pid is None or STACKS_SIGNAL is None:
        return "its stacks are unknown"
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    try:
        written = ray.get(_signal_stacks.options(scheduling_strategy=strategy).remote(pid), timeout=timeout_s)
    except Exception as err:  # its node is gone too, or too busy to run the task in time
        logger.debug("pid %s on node %s: no stacks: %s", pid, node_id, err)
        written = False
    return f"its stacks are in its log (pid {pid})" if written else "its stacks are unknown"
