"""WeightSync: new policy weights from the trainer ranks to every engine, over the routes picked once.

The routes (rayrl/weights/routes.py) come from where the engines and trainer ranks actually run, so the
same code serves one node or sixteen: node-local transports where a trainer rank shares the engine's
node, a broadcast group across nodes. :meth:`connect` plans and hands every rank its sender (again
after an engine is replaced: its address and group seat changed); :meth:`push` sends one version,
bounded by ``pipeline.weight_sync_timeout_s`` so a hung engine fails the run with a clear error instead
of hanging it. Nothing here or in the trainer actor looks at which transport it is.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from actors.trainer import TrainerGroup
from rayrl.config import RunConfig
from rayrl.pipeline.failures import TrainerFailure
from rayrl.pipeline.parts import EngineEndpoints
from rayrl.weights.files import shared_memory_root
from rayrl.weights.routes import EngineEndpoint, RankPlace, WeightRoutes, plan_routes

logger = logging.getLogger("rayrl.pipeline")


class WeightSyncError(RuntimeError):
    """A weight update to the engines failed or did not finish within ``pipeline.weight_sync_timeout_s``."""


class WeightSync:
    """Connects the trainer's senders to the engines that serve and pushes versions. It reads where the
    engines are (``engines``: the fleet, as EngineEndpoints) and never changes who serves: that is the
    engine membership's (rayrl/pipeline/membership.py)."""

    def __init__(self, cfg: RunConfig, trainer: TrainerGroup, engines: EngineEndpoints) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.engines = engines
        self.timeout_s = cfg.pipeline.weight_sync_timeout_s
        self.disk_root = str(shared_memory_root() / f"rayrl-{cfg.exp_id}-weights")
        self._places: Optional[list[RankPlace]] = None
        self._connected: Optional[list[EngineEndpoint]] = []  # the engines the senders were built for
        self.routes: Optional[WeightRoutes] = None
        self.failures = 0

    @property
    def transport(self) -> str:
        return self.routes.transport if self.routes is not None else ""

    def connect(self) -> Optional[WeightRoutes]:
        """Plan the routes over the engines now live or joining, and connect every rank's sender (None
        and nothing connected while no engine is up)."""
        if self._places is None:  # ranks never move; ask once
            self._places = self.trainer.places()
        endpoints = self.engines.endpoints()
        self._connected = endpoints
        if not endpoints:
            self.trainer.close_weights()
            self.routes = None
            return None
        routes = plan_routes(self.cfg.pipeline.weight_transfer, endpoints, self._places, self.cfg.engine.backend)
        self.trainer.connect_weights(routes, self.disk_root, self.timeout_s)
        if self.routes is None or routes.describe() != self.routes.describe():
            logger.debug("weight routes: %s", routes.describe())
        self.routes = routes
        return routes

    def push(self, version: int) -> dict[str, Any]:
        """Send the trainer's current weights to every engine that is up; returns the summed transfer
        figures. The ranks label them with the policy version they hold; ``version`` is the driver's copy of
        it, for the messages.

        Engines that are down are skipped (a replacement gets the weights when it joins); an engine that
        dies during the update is dropped and the others are sent the weights again, once."""
        for attempt in (1, 2):
            if self.engines.endpoints() != self._connected:  # an engine went down or joined since
                self.connect()
            if self.routes is None:
                logger.warning("no engine is up: policy version %d reaches the engines when they return", version)
                return {"bytes": 0, "seconds": 0.0, "senders": 0}
            refs = self.trainer.push_weights(self.cfg.engine.dtype)
            try:  # a trainer rank that died raises TrainerFailure here; what the engines did is ours
                results = self.trainer.gather("weight push", refs, timeout_s=self.timeout_s + 30, raised_fails=False)
            except TrainerFailure:
                raise
            except Exception as err:
                self.engines.refresh()
                if attempt == 1 and self.engines.endpoints() != self._connected:
                    logger.warning("an engine went down during the update to policy version %d; sending it again "
                                   "to the others", version)
                    continue
                self._fail(version, err)
            sent = [r for r in results if r]
            return {"bytes": sum(r["bytes"] for r in sent), "seconds": max((r["seconds"] for r in sent), default=0.0),
                    "senders": len(sent)}
        raise AssertionError("unreachable")

    def release_groups(self) -> None:
        """Colocated schedule, before the trainer lends its GPU: a broadcast group (``distributed``) is
        destroyed on the engines and the trainer, so its NCCL communicators hold no memory while the engines
        generate; the next :meth:`push` forms it again. The other transports hold no group: nothing to do."""
        if self.transport == "distributed":
            self.trainer.close_weights()
            self._connected = None  # push() connects again

    def _fail(self, version: int, err: Exception) -> None:
        self.failures += 1
        text = str(err).strip()
        detail = text.splitlines()[-1] if text else type(err).__name__
        message = (f"weight update to the engines (policy version {version}, {self.transport}) failed or did not "
                   f"finish within pipeline.weight_sync_timeout_s={self.timeout_s:g} s: {detail}")
        logger.error(message)
        raise WeightSyncError(message) from None

    def close(self) -> None:
        """Leave the broadcast group (before the engines stop) and remove the disk transport's files."""
        try:
            self.trainer.close_weights()
        except Exception as err:  # a dead trainer rank or engine: nothing left to close politely
            logger.warning("closing the weight senders: %s", err)
