"""SandboxPoolActor: the Ray face of rayrl.sandboxes.pool.SandboxPool (warm pool, leases, TTL, health).

A thin async shell: the pool's blocking work (creating, resetting, health-checking sandboxes) runs in a
small thread pool, and callers that must wait for a free sandbox wait on an asyncio condition, not on a
thread, so hundreds of waiting episodes cost nothing. A warm acquire never leaves the event loop: it
takes an idle sandbox directly (``SandboxPool.take_idle``: no thread hop, no I/O, no lease scan, no
stats copy) and returns; refills, expiry, health checks and metric export happen in the background. A
background task expires leases, health-checks idle
sandboxes, keeps ``min_warm`` ready, reclaims the leases of owners whose Ray actor died, and exports Ray
metrics. Commands never pass through this actor: a lease carries a handle the caller opens locally with
``rayrl.sandboxes.open_sandbox`` (same node).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray
from ray.util.metrics import Counter, Gauge, Histogram

from rayrl.config import SandboxConfig, SandboxPoolConfig
from rayrl.sandboxes.factory import create_sandbox, sandbox_provider
from rayrl.sandboxes.pool import LATENCY_BUCKETS_S, Lease, SandboxPool

logger = logging.getLogger(__name__)

_ACTOR_ID = re.compile(r"^[0-9a-f]{32}$")  # ActorID.hex(): owners that are Ray actors can be checked
_WAKE_S = 0.5  # waiters re-try at least this often even without a release notification


def _actor_state(actor_id: str) -> str | None:
    """The GCS state of a Ray actor ("ALIVE", "DEAD", ...), or None when unknown.

    ``ray.util.state`` needs the dashboard's API server, which runs without the dashboard only in some
    setups; the GCS table behind ``ray._private.state.actors`` is always there. We try the GCS first and
    fall back to the public state API, so liveness works with ``include_dashboard=False`` too.
    """
    try:
        from ray._private import state as gcs_state

        info = gcs_state.actors(actor_id=actor_id)
        if info:
            return str(info.get("State"))
        return None
    except Exception:
        pass
    try:
        from ray.util.state import get_actor

        info = get_actor(actor_id, timeout=5)
        return None if info is None else str(info.state)
    except Exception:
        return None


@ray.remote(num_cpus=0)
class SandboxPoolActor:
    """Leases sandboxes to rollout workers; ``owner`` is the caller's Ray actor id (hex)."""

    def __init__(self, sandbox_config: SandboxConfig, pool_config: SandboxPoolConfig,
                 tick_s: float = 1.0, root: str | None = None) -> None:
        # ``root``: where local sandboxes live (default: the node-wide rayrl-sandboxes dir). Tests and
        # benchmarks pass their own so they never share a directory with a running job's pool.
        provider = sandbox_provider(sandbox_config.backend)
        if provider.sweep_orphans is not None:
            provider.sweep_orphans(root)  # sandboxes left on this node by a pool that crashed
        self.pool = SandboxPool(sandbox_config, pool_config,
                                factory=lambda: create_sandbox(sandbox_config, root=root))
        self.config = pool_config
        self._tick_s = max(0.05, min(tick_s, pool_config.health_interval_s))
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sandbox-pool")
        self._changed: asyncio.Condition | None = None
        self._version = 0
        self._task: asyncio.Task | None = None
        self._shut = False
        self._refilling = False
        self._reported = {"failures": 0, "reclaimed": 0}
        self._m_warm = Gauge("rayrl_sandbox_pool_warm", description="idle sandboxes ready to lease")
        self._m_leased = Gauge("rayrl_sandbox_pool_leased", description="sandboxes leased to episodes")
        self._m_latency = Histogram("rayrl_sandbox_acquire_latency_s", description="acquire wait (s)",
                                    boundaries=list(LATENCY_BUCKETS_S))
        self._m_failures = Counter("rayrl_sandbox_failures_total",
                                   description="sandbox create/reset/health/close failures")
        self._m_reclaimed = Counter("rayrl_sandbox_reclaimed_total",
                                    description="leases reclaimed (expired or dead owner)")

    # ------------------------------------------------------------------------------------------ API
    async def acquire(self, owner: str, lease_s: float | None = None, timeout: float | None = None) -> Lease:
        """A lease on a sandbox; waits up to ``timeout`` (default acquire_timeout_s), then PoolExhausted."""
        start = time.monotonic()
        self._ensure_started()
        lease = self.pool.take_idle(owner, lease_s)  # warm: on the loop, returns at once
        if lease is None:
            lease = await self._acquire_waiting(owner, lease_s, timeout, start)
        latency = time.monotonic() - start
        self.pool.record_acquire_latency(latency)
        self._m_latency.observe(latency)
        self._refill_soon()
        return lease

    async def _acquire_waiting(self, owner: str, lease_s: float | None, timeout: float | None,
                               start: float) -> Lease:
        """No idle sandbox: expire leases, create one if under max_size, else wait for a change."""
        wait_s = self.config.acquire_timeout_s if timeout is None else float(timeout)
        deadline = start + wait_s
        while True:
            version = self._version
            lease = await self._call(self.pool.try_acquire, owner, lease_s)
            if lease is not None:
                return lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.pool.exhausted(wait_s)
            await self._wait_change(version, min(remaining, _WAKE_S))

    async def release(self, lease_id: str) -> bool:
        """Return a lease; False if it had already ended (expired or reclaimed)."""
        self._ensure_started()
        released = await self._call(self.pool.release, lease_id)
        await self._bump()
        self._export()
        return released

    async def warm(self) -> int:
        """Start the upkeep and make ``min_warm`` sandboxes now (the run's start, while the engines and the
        trainer load), so the first episodes lease warm ones instead of each making its own; returns how
        many are idle. The upkeep starts after the fill: two fills at once would each make the missing ones."""
        self._changed = self._changed or asyncio.Condition()
        made = await self._call(self.pool.fill_warm)
        self._ensure_started()
        if made:
            await self._bump()
        self._export()
        return self.pool.gauges()["warm"]

    async def reclaim_owner(self, owner: str) -> int:
        """Take back every lease of ``owner`` now (e.g. a worker the caller knows has died)."""
        self._ensure_started()
        n = await self._call(self.pool.reclaim_owner, owner)
        await self._bump()
        return n

    async def stats(self) -> dict[str, Any]:
        self._ensure_started()
        return self.pool.stats()

    async def shutdown(self) -> dict[str, Any]:
        """Stop upkeep and close every sandbox; returns the final stats."""
        self._shut = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self._call(self.pool.shutdown)
        await self._bump()
        self._export()
        return self.pool.stats()

    # ------------------------------------------------------------------------------------ internals
    def _ensure_started(self) -> None:
        if self._task is None and not self._shut:
            self._changed = self._changed or asyncio.Condition()
            self._task = asyncio.get_running_loop().create_task(self._upkeep())
        elif self._changed is None:
            self._changed = asyncio.Condition()

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _bump(self) -> None:
        """Wake waiters: capacity may have changed (none yet if nobody ever acquired)."""
        if self._changed is None:
            return
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def _wait_change(self, version: int, timeout: float) -> None:
        assert self._changed is not None
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._version != version), timeout)
            except asyncio.TimeoutError:
                pass

    def _refill_soon(self) -> None:
        if self._refilling or not self.pool.wants_refill():
            return
        self._refilling = True

        async def refill() -> None:
            try:
                if await self._call(self.pool.fill_warm):
                    await self._bump()
            finally:
                self._refilling = False

        asyncio.get_running_loop().create_task(refill())

    async def _upkeep(self) -> None:
        """Expire leases, health-check, refill, reclaim dead owners, export metrics; forever."""
        while True:
            try:
                result = await self._call(self.pool.maintain)
                dead = await self._call(self._dead_owners)
                reclaimed = 0
                for owner in dead:
                    reclaimed += await self._call(self.pool.reclaim_owner, owner)
                if reclaimed or any(result.values()):
                    await self._bump()
                self._export()
            except asyncio.CancelledError:
                raise
            except Exception:  # upkeep must survive anything; the failure is logged each time
                logger.exception("sandbox pool upkeep failed")
            await asyncio.sleep(self._tick_s)

    def _dead_owners(self) -> list[str]:
        return [o for o in self.pool.owners() if _ACTOR_ID.match(o) and _actor_state(o) == "DEAD"]

    def _export(self) -> None:
        s = self.pool.gauges()
        self._m_warm.set(s["warm"])
        self._m_leased.set(s["leased"])
        for key, metric in (("failures", self._m_failures), ("reclaimed", self._m_reclaimed)):
            delta = s[key] - self._reported[key]
            if delta > 0:
                metric.inc(delta)
                self._reported[key] = s[key]
