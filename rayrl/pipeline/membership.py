"""EngineMembership: the one owner of which engines serve: the fleet's states, the routers' engine list
and the weights a joining engine needs before it serves.

An engine that died is taken out of the gateway's routers at once (the fleet starts its replacement on
the same seat). A replacement that has started is *joining*: it gets the current weights first (policy
version 0: the senders are only connected to it, the engines all start from the same checkpoint), then
the fleet marks it live and only then do the routers learn its address, so no LLM call ever reaches an
engine with stale weights. The schedule says when an engine may join (colocated: not while the trainer
holds the devices) and how weights reach the engines with calls in flight (its ``update_engines``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

from rayrl.pipeline.parts import Engines, Gateway, Weights

logger = logging.getLogger("rayrl.pipeline")


class EngineMembership:
    """Tends the fleet: routes around engines that went down and lets replacements in with the current
    weights."""

    def __init__(self, engines: Engines, weights: Weights, gateway: Gateway, failures: Counter) -> None:
        self.engines = engines
        self.weights = weights
        self.gateway = gateway
        self.failures = failures  # the run's failure counts (``engine_restarts``)

    def tend(self, may_join: bool, version: int, update_engines: Callable[[], None]) -> None:
        """Take engines that died out of the routers; when ``may_join``, give replacements that have started
        policy ``version`` (``update_engines``: the schedule's way of pushing it), then route to them."""
        events = self.engines.poll(start_replacements=may_join)
        down = [e for e in events if e.kind == "down"]
        for event in down:
            self.failures["engine_restarts"] += 1
            logger.warning("engine %d at %s is down (%s); routing around it while it is replaced",
                           event.index, event.url, event.detail)
        if down:
            self.gateway.set_engines(self.engines.urls)
        joining = [s for s in self.engines.slots if s.state == "joining"]
        if not joining or not may_join:
            return
        if version > 0:  # senders are rebuilt for the new address (and broadcast seat) first
            update_engines()  # as after a step: with nothing generating on the engines already live
        else:
            self.weights.connect()
        for slot in joining:
            self.engines.mark_live(slot.index)
            logger.warning("engine %d back at %s on node %s with policy version %d", slot.index, slot.url,
                           str(slot.info.get("node_id", ""))[:12], version)
        self.gateway.set_engines(self.engines.urls)
