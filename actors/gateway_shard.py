"""GatewayShard: a Ray actor hosting the gateway and its per-session trajectory trees.

Sessions are sharded over N actors by session id: a session id starts with ``s<shard>-``, so
``GatewayShards`` routes each call to the actor that owns the session without a lookup table.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections import Counter
from typing import Any

import ray

from actors.runtime import on_driver_node
from rayrl.config import RunConfig
from rayrl.engines.api import LORA_ADAPTER
from rayrl.gateway.admin_stats import gateway_stats
from rayrl.gateway.admin_trees import describe_session
from rayrl.gateway.app import Gateway, settle_heap
from rayrl.gateway.sessions import SessionInfo
from rayrl.types import Sample


def tokenizer_only_transformers() -> None:
    """Have transformers load without torch in this process, which only tokenizes and renders (the tokenizer,
    its config and chat template need no torch).

    Why: with torch installed, ``from transformers import AutoTokenizer`` imports torch too, some 2,500
    modules instead of 640, several times the time (docs/results/design_figures.md), spent in every shard's
    start while the engines and the trainer load on the same cores.
    Only before transformers is first imported, and only in an actor's own process: set in a process that
    later loads a model through transformers, it would find no torch.
    """
    if "transformers" not in sys.modules:
        os.environ["USE_TORCH"] = "0"
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "None of PyTorch ... found"


@ray.remote(num_cpus=0)
class GatewayShard:
    """Gateway server + sessions for one shard (an async actor: the HTTP server shares its loop)."""

    def __init__(self, cfg: RunConfig, model_path: str, engine_urls: list[str], shard: int = 0) -> None:
        tokenizer_only_transformers()
        from transformers import AutoConfig, AutoTokenizer

        from rayrl.engines.router import Router

        logging.basicConfig(level=cfg.logging.log_level)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        # cfg is resolved: tokenizer_path is model.path unless another tokenizer is named, and model_path is
        # where model.path lives on disk
        same = cfg.model.tokenizer_path == cfg.model.path
        tokenizer = AutoTokenizer.from_pretrained(model_path if same else cfg.model.tokenizer_path)
        model_type = getattr(AutoConfig.from_pretrained(model_path), "model_type", "")
        self.router = Router(engine_urls, wait_timeout_s=cfg.pipeline.generation_wait_timeout_s,
                             lora_path=LORA_ADAPTER if cfg.trainer.lora.enabled else None)
        self.gateway = Gateway(
            cfg.gateway,
            cfg.trajectory,
            tokenizer,
            self.router,
            model_name=cfg.model.path,
            context_length=cfg.engine.context_length,
            chat_template=cfg.model.chat_template,
            shard=shard,
            model_type=model_type,
        )
        self.totals: Counter = Counter()
        self.describe_trees = cfg.logging.inspect_episodes_per_step > 0  # the run records keep every tree

    async def start(self) -> str:
        """Serve the gateway; bound to every interface, its URL names this node's address."""
        url = await self.gateway.start(advertise_host=ray.util.get_node_ip_address())
        settle_heap()  # the actor hosts the gateway: full collections no longer walk its libraries
        return url

    async def open_session(self, metadata: dict[str, Any] | None = None) -> SessionInfo:
        return self.gateway.open_session(metadata)

    async def finish_session(
        self, session_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> list[Sample]:
        self._count(self.gateway.session_stats(session_id))
        return await self.gateway.finish_session(session_id, reward, metadata)

    async def finish_session_with_tree(
        self, session_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> tuple[list[Sample], dict[str, Any] | None]:
        """``finish_session`` and the session's tree described for the run records (None when the run keeps
        none). Nothing awaits between reading the tree and finishing, so the tree holds every sampled turn."""
        tree = describe_session(self.gateway.sessions, session_id) if self.describe_trees else None
        return await self.finish_session(session_id, reward, metadata), tree

    def _count(self, tree_stats: dict[str, Any]) -> None:
        """Session totals (drift by kind, merges, forks) for the step metrics."""
        for key in ("turns", "forks", "merged_rewrites", "masked_tokens"):
            self.totals[key] += int(tree_stats.get(key, 0))
        for kind, n in tree_stats.get("drift", {}).items():
            self.totals[f"drift_{kind}"] += int(n)
        self.totals["sessions_finished"] += 1

    async def session_stats(self, session_id: str) -> dict[str, Any]:
        return self.gateway.session_stats(session_id)

    async def stats(self) -> dict[str, Any]:
        router = {f"router_{k}": v for k, v in self.router.stats().items()}
        return {**gateway_stats(self.gateway), **self.totals, **router}

    async def set_engines(self, urls: list[str]) -> None:
        """Route LLM calls to exactly these engines (rayrl/orchestration/membership.py calls this as engines die
        and return)."""
        self.router.set_engines(urls)

    async def hold_llm_calls(self) -> None:
        """Queue new LLM calls at this shard's router (a weight update or the trainer's turn on the devices
        is coming); the engines' own pause is EngineFleet.pause_generation."""
        self.router.pause()

    async def release_llm_calls(self) -> None:
        self.router.resume()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no LLM call of this shard is at an engine; False when ``timeout_s`` passed first."""
        return await self.router.drain(timeout_s)

    async def admin_token(self) -> str:
        return self.gateway.admin_token

    async def shutdown(self) -> None:
        await self.gateway.stop()
        await self.router.close()


class GatewayShards:
    """Client-side handle over the shards: new sessions round-robin, calls routed by session id; to the
    schedules it is the gateway (rayrl/orchestration/parts.py Gateway): where LLM calls go and whether they
    wait."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self._next = itertools.count()
        self.starting: list[Any] = []  # the shards' pending start() calls (start_gateway_shards)

    def started(self) -> list[str]:
        """Wait until every shard serves; their gateway URLs."""
        urls, self.starting = ray.get(self.starting), []
        return urls

    def kill(self) -> None:
        """End every shard at once (a run whose start failed)."""
        for handle in self.handles:
            ray.kill(handle)

    def shard_of(self, session_id: str) -> Any:
        try:
            shard = int(session_id.split("-", 1)[0][1:])
            return self.handles[shard]
        except (ValueError, IndexError):
            raise KeyError(f"session id {session_id!r} names no gateway shard") from None

    def open_session(self, metadata: dict[str, Any]) -> SessionInfo:
        handle = self.handles[next(self._next) % len(self.handles)]
        return ray.get(handle.open_session.remote(metadata))

    def session_stats(self, session_id: str) -> dict[str, Any]:
        """The session's counters (turns, drift, infrastructure errors the gateway answered it with)."""
        return ray.get(self.shard_of(session_id).session_stats.remote(session_id))

    def finish_session(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list[Sample]:
        return ray.get(self.shard_of(session_id).finish_session.remote(session_id, reward, metadata))

    def finish_session_with_tree(
        self, session_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> tuple[list[Sample], dict[str, Any] | None]:
        """The samples and the session's tree for the run records (None when inspection is off)."""
        return ray.get(self.shard_of(session_id).finish_session_with_tree.remote(session_id, reward, metadata))

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([h.stats.remote() for h in self.handles])

    def set_engines(self, urls: list[str]) -> None:
        """Every shard's router sends LLM calls to exactly these engines."""
        ray.get([h.set_engines.remote(list(urls)) for h in self.handles])

    def hold_llm_calls(self) -> None:
        """Queue new LLM calls at every shard's router until :meth:`release_llm_calls`."""
        ray.get([h.hold_llm_calls.remote() for h in self.handles])

    def release_llm_calls(self) -> None:
        ray.get([h.release_llm_calls.remote() for h in self.handles])

    def drain(self, timeout_s: float) -> bool:
        """True once no shard has a call at an engine; False if ``timeout_s`` passed first."""
        return all(ray.get([h.drain.remote(timeout_s) for h in self.handles]))

    def queue_depth(self) -> int:
        return sum(s.get("router_queue_depth", 0) for s in self.stats())

    def shutdown(self) -> list[Any]:
        """Refs of every shard's graceful stop."""
        return [h.shutdown.remote() for h in self.handles]


def start_gateway_shards(cfg: RunConfig, model_path: str, engine_urls: list[str],
                         wait: bool = True) -> GatewayShards:
    """The shards, serving once :meth:`GatewayShards.started` returns (at once with ``wait``). The
    handles are usable before that: the run's start hands them to the rollout workers while the shards
    load their tokenizer, and gives them the engines' addresses (``set_engines``) once the engines are up."""
    handles = [
        GatewayShard.options(name=f"rayrl-{cfg.exp_id}-gateway-{i}", **on_driver_node()).remote(
            cfg, model_path, engine_urls, i)
        for i in range(cfg.trajectory.num_shards)
    ]
    managers = GatewayShards(handles)
    managers.starting = [h.start.remote() for h in handles]
    if wait:
        managers.started()
    return managers
