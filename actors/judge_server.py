"""The judge a run serves (``rollout.judge.serve``): its own engines and an OpenAI-compatible endpoint.

A second engine group, like the distillation teacher's (actors/pipeline.py): an EngineFleet of
``rollout.judge.num_engines`` engines serving the judge model with the run's ``engine.*`` settings (LoRA
off), outside the shared placement (a placement refuses ``rollout.judge.serve`` at load) and outside the
policy's fleet, so it is frozen: no weight update, pause or memory release of the schedule reaches it.
In front of it, a JudgeEndpoint actor on the driver's node hosts rayrl/gateway/frozen.py (the gateway's
routes, recording nothing); the rollout workers, on that node too, get a config whose ``rollout.judge``
points at it (:meth:`ServedJudge.run_config`), so the judge reward and an environment's JudgeRubric ask it
as they ask any endpoint, with the same bounds, retries and failures (``judge_failed``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import ray

from actors.engine_fleet import EngineFleet
from actors.runtime import on_driver_node
from rayrl.config import RunConfig
from rayrl.models import resolve_model_path
from rayrl.rewards.judge import served_judge_config

logger = logging.getLogger("rayrl.judge")


@ray.remote(num_cpus=0)
class JudgeEndpoint:
    """rayrl/gateway/frozen.py's endpoint in an async actor (its HTTP server shares the actor's loop)."""

    def __init__(self, model_path: str, engine_urls: list[str], model_name: str, context_length: int,
                 wait_timeout_s: float, log_level: str) -> None:
        from rayrl.gateway.frozen import FrozenEndpoint

        logging.basicConfig(level=log_level)
        self.endpoint = FrozenEndpoint(model_path, engine_urls, model_name=model_name,
                                       context_length=context_length, wait_timeout_s=wait_timeout_s)

    async def start(self) -> str:
        return await self.endpoint.start()

    async def stats(self) -> dict[str, Any]:
        return self.endpoint.stats()

    async def shutdown(self) -> None:
        await self.endpoint.stop()


class ServedJudge:
    """The judge's engines and endpoint, started by :meth:`start` and stopped by :meth:`shutdown`."""

    def __init__(self, engines: EngineFleet, endpoint: Any, base_url: str) -> None:
        self.engines = engines
        self.endpoint = endpoint
        self.base_url = base_url

    @classmethod
    def start(cls, cfg: RunConfig, name: str, log_dir: str) -> Optional["ServedJudge"]:
        """Start what ``rollout.judge.serve`` names (None when it is unset)."""
        judge = cfg.rollout.judge
        if not judge.serve:
            return None
        path = str(resolve_model_path(judge.serve, "rollout.judge.serve"))
        engine_cfg = dataclasses.replace(cfg.engine, num_engines=judge.num_engines, max_lora_rank=0)
        engines = EngineFleet(engine_cfg, path, log_dir, [None] * judge.num_engines, name_prefix=f"{name}-judge")
        endpoint = None
        try:
            endpoint = JudgeEndpoint.options(name=f"{name}-judge-endpoint", **on_driver_node()).remote(
                path, engines.urls, judge.serve, cfg.engine.context_length, cfg.pipeline.generation_wait_timeout_s,
                cfg.logging.log_level)
            base_url = ray.get(endpoint.start.remote())
        except BaseException:
            if endpoint is not None:
                ray.kill(endpoint)
            engines.shutdown()
            raise
        print(f"[rayrl] judge {judge.serve} at {base_url} (engines: {', '.join(engines.urls)})", flush=True)
        return cls(engines, endpoint, base_url)

    def run_config(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` as the rollout workers take it: ``rollout.judge`` is this judge's endpoint."""
        return dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, judge=served_judge_config(cfg.rollout.judge, self.base_url)))

    def stats(self) -> dict[str, Any]:
        return ray.get(self.endpoint.stats.remote())

    def shutdown(self) -> None:
        try:
            ray.get(self.endpoint.shutdown.remote(), timeout=30)
        except Exception as err:  # an endpoint that died cannot be stopped politely; it is killed below
            logger.warning("judge endpoint: graceful shutdown incomplete: %s", err)
        ray.kill(self.endpoint)
        self.engines.shutdown()
