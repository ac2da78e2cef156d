"""EngineMembership: the one owner of which engines serve: the fleet's states, the routers' engine list,
which engines a weight update goes to, and the weights a joining engine needs before it serves.

An engine that died is taken out of the gateway's routers at once (the fleet starts its replacement on
the same seat). A replacement that has started is *joining*: it gets the current weights first (policy
version 0: the senders are only connected to it, the engines all start from the same checkpoint, unless
the policy is a LoRA adapter, which the engines load even at version 0), then
the fleet marks it live and only then do the routers learn its address, so no LLM call ever reaches an
engine with stale weights. The schedule says when an engine may join (colocated: not while the trainer
holds the devices) and how weights reach the engines with calls in flight (its ``update_engines``, which
calls :meth:`EngineMembership.push_weights`). The weight sync is handed the engines to update and never
looks at the fleet: when an update fails, the membership asks the fleet whether an engine died meanwhile
and, if one did, sends the weights again to the others, once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

from rayrl.orchestration.part_failures import WeightSyncError
from rayrl.orchestration.parts import Engines, Gateway, Weights

logger = logging.getLogger(__name__)


class EngineMembership:
    """Tends the fleet: routes around engines that went down and lets replacements in with the current
    weights."""

    def __init__(self, engines: Engines, weights: Weights, gateway: Gateway, failures: Counter) -> None:
        self.engines = engines
        self.weights = weights
        self.gateway = gateway
        self.failures = failures  # the run's failure counts (``engine_restarts``, ``weight_sync_failures``)

    def push_weights(self, version: int) -> dict[str, Any]:
        """Policy ``version`` to every engine that serves or is joining; the weight sync's transfer figures.

        Engines that are down are left out (a replacement gets the weights when it joins). When the update
        fails, the fleet is brought up to date: if an engine died during it, the others are sent the
        weights again, once (the next :meth:`tend` routes around the dead one); otherwise, or when the
        second try fails too, the failure is counted (``weight_sync_failures``), logged and raised."""
        endpoints = self.engines.endpoints()
        for attempt in (1, 2):
            try:
                return self.weights.push(version, endpoints)
            except WeightSyncError as err:
                self.engines.refresh()  # engines that died are down now; the next tend hands out the events
                left = self.engines.endpoints()
                if attempt == 1 and left != endpoints:
                    logger.warning("an engine went down during the update to policy version %d; sending it "
                                   "again to the others", version)
                    endpoints = left
                    continue
                self.failures["weight_sync_failures"] += 1
                logger.error("%s", err)
                raise
        raise AssertionError("unreachable")

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
        if version > 0 or self.weights.adapter_only:  # senders are rebuilt for the new address first (a LoRA
            update_engines()  # adapter is needed even at version 0); as after a step, nothing generating
        else:
            self.weights.connect(self.engines.endpoints())
        for slot in joining:
            self.engines.mark_live(slot.index)
            logger.warning("engine %d back at %s on node %s with policy version %d", slot.index, slot.url,
                           str(slot.info.get("node_id", ""))[:12], version)
        self.gateway.set_engines(self.engines.urls)
