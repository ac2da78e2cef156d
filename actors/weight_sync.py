"""WeightSync: new policy weights from the trainer ranks to every engine, as the weight plan says.

The weight plan (rayrl/weights/plan.py) comes from where the engines and trainer ranks actually run, so the
same code serves one node or sixteen: node-local transports where a trainer rank shares the engine's
node, a broadcast group across nodes. :meth:`connect` plans and hands every rank its sender (again
after an engine is replaced: its address and group seat changed); :meth:`push` sends one version,
bounded by ``pipeline.weight_sync_timeout_s`` so a hung engine fails the run with a clear error instead
of hanging it. Nothing here or in the trainer actor looks at which transport it is.

Which engines take the weights is given to it (the endpoints the engine membership reads from the fleet,
rayrl/orchestration/membership.py); it never looks at the fleet, and whether a failed update goes again to
the engines left after one died is the membership's call.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from actors.trainer import TrainerGroup
from rayrl.config import RunConfig
from rayrl.orchestration.part_failures import TrainerFailure, WeightSyncError
from rayrl.weights.owners import shared_memory_root
from rayrl.weights.plan import EngineEndpoint, RankPlace, WeightPlan, plan_senders

logger = logging.getLogger("rayrl.weights")


class WeightSync:
    """Connects the trainer's senders to the engines it is given and pushes versions to them."""

    def __init__(self, cfg: RunConfig, trainer: TrainerGroup) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.timeout_s = cfg.pipeline.weight_sync_timeout_s
        self.disk_root = str(shared_memory_root() / f"rayrl-{cfg.exp_id}-weights")
        self._places: Optional[list[RankPlace]] = None
        self._connected: Optional[list[EngineEndpoint]] = []  # the engines the senders were built for
        self.plan: Optional[WeightPlan] = None
        self.adapter_only = cfg.trainer.lora.enabled  # updates are the LoRA adapter (rayrl/weights/adapter.py)

    @property
    def transport(self) -> str:
        return self.plan.transport if self.plan is not None else ""

    def connect(self, endpoints: list[EngineEndpoint]) -> Optional[WeightPlan]:
        """Plan who sends to ``endpoints`` (the engines live or joining) and connect every rank's sender
        (None and nothing connected when there are none)."""
        if self._places is None:  # ranks never move; ask once
            self._places = self.trainer.places()
        self._connected = list(endpoints)
        if not endpoints:
            self.trainer.close_weights()
            self.plan = None
            return None
        plan = plan_senders(self.cfg.pipeline.weight_transfer, endpoints, self._places, self.cfg.engine.backend,
                            lora=self.cfg.trainer.lora.enabled)
        self.trainer.connect_weights(plan, self.disk_root, self.timeout_s)
        if self.plan is None or plan.describe() != self.plan.describe():
            logger.debug("weight plan: %s", plan.describe())
        self.plan = plan
        return plan

    def push(self, version: int, endpoints: list[EngineEndpoint]) -> dict[str, Any]:
        """Send the trainer's current weights to ``endpoints`` (connecting the senders first when they
        differ from the last ones); returns the summed transfer figures. The ranks label the weights with
        the policy version they hold; ``version`` is the driver's copy of it, for the messages.

        With no endpoint nothing is sent (a replacement gets the weights when it joins). A trainer rank that
        dies raises TrainerFailure; any other failure, WeightSyncError (the membership sees whether an
        engine died and sends again)."""
        if endpoints != self._connected:  # an engine went down or joined since
            self.connect(endpoints)
        if self.plan is None:
            logger.warning("no engine is up: policy version %d reaches the engines when they return", version)
            return {"bytes": 0, "seconds": 0.0, "senders": 0}
        refs = self.trainer.push_weights(self.cfg.engine.dtype)
        try:  # a trainer rank that died raises TrainerFailure here; what the engines did is ours
            results = self.trainer.gather("weight push", refs, timeout_s=self.timeout_s + 30, raised_fails=False)
        except TrainerFailure:
            raise
        except Exception as err:
            raise self._error(version, err) from None
        sent = [r for r in results if r]
        return {"bytes": sum(r["bytes"] for r in sent), "seconds": max((r["seconds"] for r in sent), default=0.0),
                "senders": len(sent)}

    def release_groups(self) -> None:
        """Colocated schedule, before the trainer lends its GPU: a broadcast group (``distributed``) is
        destroyed on the engines and the trainer, so its NCCL communicators hold no memory while the engines
        generate; the next :meth:`push` forms it again. The other transports hold no group: nothing to do."""
        if self.transport == "distributed":
            self.trainer.close_weights()
            self._connected = None  # push() connects again

    def _error(self, version: int, err: Exception) -> WeightSyncError:
        text = str(err).strip()
        detail = text.splitlines()[-1] if text else type(err).__name__
        return WeightSyncError(f"weight update to the engines (policy version {version}, {self.transport}) failed "
                               f"or did not finish within pipeline.weight_sync_timeout_s={self.timeout_s:g} s: "
                               f"{detail}")

    def close(self) -> None:
        """Leave the broadcast group (before the engines stop) and remove the disk transport's files."""
        try:
            self.trainer.close_weights()
        except Exception as err:  # a dead trainer rank or engine: nothing left to close politely
            logger.warning("closing the weight senders: %s", err)
