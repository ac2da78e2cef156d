"""Router: spreads generate calls over engine servers, keeping each session on one engine.

Affinity: rendezvous (highest-random-weight) hashing of the session key picks the preferred engine, so
consecutive turns of an agent land where their prefix was last seen (SGLang's radix cache reuses it on
GPU) and adding or removing an engine only moves the sessions that engine owned. Load: the router
counts requests in flight per engine; when the preferred engine has ``imbalance_abs`` more than the
least-loaded one and more than ``imbalance_rel`` times as many, the request goes to the least-loaded
engine instead (SGLang router's cache-aware policy uses the same two thresholds).

Routing runs in the caller's process: one EngineClient per URL, no extra hop.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from rayrl.engines.client import EngineClient, EngineUnavailable, GenerateOutput

logger = logging.getLogger(__name__)


def _score(url: str, key: str) -> int:
    digest = hashlib.blake2b(f"{url}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    """Session-affine, load-aware routing of ``generate`` calls over engine URLs."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 600.0,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
    ) -> None:
        self.timeout_s = timeout_s
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self._clients: dict[str, EngineClient] = {}
        self._in_flight: dict[str, int] = {}
        self._retired: list[EngineClient] = []
        self.routed = {"affinity": 0, "load_fallback": 0, "retried": 0}
        for url in urls:
            self.add(url)

    @property
    def clients(self) -> dict[str, EngineClient]:
        """URL -> EngineClient (a copy; use add/remove to change the set)."""
        return dict(self._clients)

    @property
    def urls(self) -> list[str]:
        return list(self._clients)

    @property
    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def add(self, url: str) -> EngineClient:
        """Start routing to ``url`` (idempotent)."""
        url = url.rstrip("/")
        if url not in self._clients:
            self._clients[url] = EngineClient(url, timeout_s=self.timeout_s)
            self._in_flight[url] = 0
        return self._clients[url]

    def remove(self, url: str) -> None:
        """Stop routing new requests to ``url``; requests already there finish normally."""
        client = self._clients.pop(url.rstrip("/"), None)
        self._in_flight.pop(url.rstrip("/"), None)
        if client is not None:
            self._retired.append(client)

    def ranking(self, session_key: str) -> list[str]:
        """Engines in this session's rendezvous order (first = preferred)."""
        return sorted(self._clients, key=lambda url: _score(url, session_key), reverse=True)

    def pick(self, session_key: Optional[str], exclude: Sequence[str] = ()) -> str:
        """The engine for the next request of ``session_key`` (None: least loaded)."""
        candidates = [u for u in self._clients if u not in exclude]
        if not candidates:
            raise EngineUnavailable("no engine servers to route to")
        least = min(candidates, key=lambda u: self._in_flight[u])
        if session_key is None:
            return least
        preferred = next(u for u in self.ranking(session_key) if u in candidates)
        busy, idle = self._in_flight[preferred], self._in_flight[least]
        if busy - idle >= self.imbalance_abs and busy > self.imbalance_rel * idle:
            self.routed["load_fallback"] += 1
            return least
        self.routed["affinity"] += 1
        return preferred

    async def generate(
        self,
        session_key: Optional[str],
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]] = None,
        rid: Optional[str] = None,
        return_logprob: bool = True,
    ) -> GenerateOutput:
        """Generate on the engine chosen for ``session_key``. When the engine cannot even be connected
        to (so nothing ran there), retry once on another engine; other failures propagate."""
        tried: list[str] = []
        while True:
            url = self.pick(session_key, exclude=tried)
            client = self._clients[url]
            self._in_flight[url] += 1
            try:
                return await client.generate(
                    input_ids, sampling_params, rid=rid, return_logprob=return_logprob
                )
            except EngineUnavailable as err:
                tried.append(url)
                if not err.connect_failed or len(tried) >= 2 or len(tried) >= len(self._clients):
                    raise
                self.routed["retried"] += 1
                logger.warning("engine %s unavailable (%s); retrying on another engine", url, err.message)
            finally:
                if url in self._in_flight:
                    self._in_flight[url] -= 1

    async def close(self) -> None:
        for client in list(self._clients.values()) + self._retired:
            await client.close()
        self._retired.clear()
