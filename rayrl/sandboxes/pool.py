"""SandboxPool: warm sandboxes leased to episodes, reclaimed on release, expiry or owner death.

Plain thread-safe Python (one lock, one condition) so it is testable without Ray; SandboxPoolActor wraps
it. Slow work (creating, resetting, health-checking, closing sandboxes) always happens outside the lock.

Life of a sandbox: created (on demand or to keep ``min_warm`` idle) -> idle -> leased -> on release,
expiry or reclaim it is reset (fresh working directory, everything it ran killed) and goes back to idle,
or is closed once it has served ``recycle_after`` leases or when a reset or health check fails. Every
failure is counted in :meth:`SandboxPool.stats` and logged; a sandbox that cannot be reset is never
handed out again.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rayrl.config import SandboxConfig, SandboxPoolConfig
from rayrl.sandboxes.base import Sandbox, SandboxError, SandboxHandle
from rayrl.sandboxes.factory import create_sandbox

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the acquire-latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
_RECENT_LATENCIES = 1024
_HEALTH_TIMEOUT_S = 10.0
_MAX_WAIT_TICK_S = 1.0  # waiters wake at least this often to notice expired leases


def _new_lease_id() -> str:
    return "lease-" + secrets.token_hex(8)


class PoolExhausted(SandboxError):
    """No sandbox became free within the acquire timeout."""


class PoolClosed(SandboxError):
    """The pool was shut down."""


@dataclass(frozen=True)
class Lease:
    """The right to use one sandbox until ``expires_at`` (unix time) or release."""

    lease_id: str
    handle: SandboxHandle
    owner: str
    expires_at: float


@dataclass
class _Slot:
    sandbox: Sandbox
    uses: int = 0
    checked_at: float = field(default_factory=time.monotonic)
    # The id of this slot's next lease, fenced into the sandbox while it is idle (no handle carries it
    # yet, so nobody can use the sandbox) so that granting it needs no file write on the hot path.
    next_lease: str | None = None


class SandboxPool:
    """Warm pool with leases, expiry, owner reclaim, health checks and backpressure (thread-safe)."""

    def __init__(self, sandbox_config: SandboxConfig, pool_config: SandboxPoolConfig,
                 factory: Callable[[], Sandbox] | None = None) -> None:
        if pool_config.min_warm > pool_config.max_size:
            raise ValueError("sandbox_pool.min_warm must not exceed sandbox_pool.max_size")
        self.sandbox_config = sandbox_config
        self.config = pool_config
        self._factory = factory or (lambda: create_sandbox(sandbox_config))
        self._cond = threading.Condition()
        self._idle: collections.deque[_Slot] = collections.deque()
        self._leases: dict[str, tuple[Lease, _Slot]] = {}
        self._busy = 0  # sandboxes being created, reset, health-checked or closed: live but unusable
        self._closed = False
        self._counts = dict.fromkeys(
            ("created", "destroyed", "recycled", "failures", "create_failures", "reset_failures",
             "unhealthy", "close_failures", "reclaimed", "expired", "owner_reclaimed", "exhausted",
             "stale_releases", "leases_granted", "released"), 0)
        self._latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self._latencies: collections.deque[float] = collections.deque(maxlen=_RECENT_LATENCIES)

    # --------------------------------------------------------------------------------------- leasing
    def acquire(self, owner: str, lease_s: float | None = None, timeout: float | None = None) -> Lease:
        """Lease a sandbox, waiting up to ``timeout`` (default acquire_timeout_s); raises PoolExhausted."""
        wait_s = self.config.acquire_timeout_s if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + wait_s
        while True:
            self.expire_leases()
            with self._cond:
                slot, reserved = self._take_locked()
                if slot is None and not reserved:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._exhausted_locked(wait_s)
                    self._cond.wait(min(remaining, self._until_next_expiry_locked()))
                    continue
            lease = self._grant(slot if slot is not None else self._create_reserved(), owner, lease_s)
            self.record_acquire_latency(time.monotonic() - start)
            return lease

    def try_acquire(self, owner: str, lease_s: float | None = None) -> Lease | None:
        """Lease a sandbox now (creating one if under max_size) or return None; never waits for others.

        For asyncio callers (the actor), which wait between attempts without blocking a thread and then
        report via :meth:`record_acquire_latency` / :meth:`exhausted`.
        """
        self.expire_leases()
        with self._cond:
            slot, reserved = self._take_locked()
            if slot is None and not reserved:
                return None
        return self._grant(slot if slot is not None else self._create_reserved(), owner, lease_s)

    def take_idle(self, owner: str, lease_s: float | None = None) -> Lease | None:
        """Lease an idle sandbox at once, or None when none is idle: no waiting, no creating, no scan.

        The hot path of the asyncio actor, cheap enough to run on its event loop: a lock and no I/O (the
        lease id was fenced into the sandbox when it became idle). Expiry, creation and waiting stay on
        :meth:`try_acquire`.
        """
        with self._cond:
            if self._closed:
                raise PoolClosed("the sandbox pool is shut down")
            if not self._idle:
                return None
            slot = self._idle.popleft()
            self._busy += 1
        return self._grant(slot, owner, lease_s)

    def wants_refill(self) -> bool:
        """Whether fewer than ``min_warm`` sandboxes are idle and there is room to create more."""
        with self._cond:
            live = len(self._idle) + len(self._leases) + self._busy
            return (not self._closed and len(self._idle) < self.config.min_warm
                    and live < self.config.max_size)

    def release(self, lease_id: str) -> bool:
        """End a lease: the sandbox is reset (or recycled) for the next one. False if the lease was
        unknown (already released, expired or reclaimed): counted as a stale release, not an error."""
        with self._cond:
            entry = self._leases.pop(lease_id, None)
            if entry is None:
                self._counts["stale_releases"] += 1
                return False
            self._counts["released"] += 1
            self._busy += 1
        self._return(entry[1])
        return True

    def reclaim_owner(self, owner: str) -> int:
        """Take back every lease held by ``owner`` (a dead rollout worker); returns how many."""
        with self._cond:
            ids = [lid for lid, (lease, _) in self._leases.items() if lease.owner == owner]
            slots = [self._leases.pop(lid)[1] for lid in ids]
            self._busy += len(slots)
            self._counts["reclaimed"] += len(slots)
            self._counts["owner_reclaimed"] += len(slots)
        for slot in slots:
            self._return(slot)
        if slots:
            logger.warning("reclaimed %d sandbox lease(s) of dead owner %s", len(slots), owner)
        return len(slots)

    def expire_leases(self) -> int:
        """Reclaim leases past their ``expires_at``; returns how many."""
        now = time.time()
        with self._cond:
            ids = [lid for lid, (lease, _) in self._leases.items() if lease.expires_at <= now]
            slots = [self._leases.pop(lid)[1] for lid in ids]
            self._busy += len(slots)
            self._counts["reclaimed"] += len(slots)
            self._counts["expired"] += len(slots)
        for lid, slot in zip(ids, slots):
            logger.warning("sandbox lease %s expired; reclaiming %s", lid, slot.sandbox.sandbox_id)
            self._return(slot)
        return len(slots)

    def owners(self) -> set[str]:
        """Owners currently holding leases (the actor checks whether they are still alive)."""
        with self._cond:
            return {lease.owner for lease, _ in self._leases.values()}

    # ---------------------------------------------------------------------------------- maintenance
    def health_check(self, max_age_s: float | None = None) -> int:
        """Run ``true`` in idle sandboxes not checked for ``max_age_s`` (default health_interval_s);
        broken ones are closed and counted. Returns how many were replaced."""
        max_age = self.config.health_interval_s if max_age_s is None else max_age_s
        broken = 0
        for _ in range(self.config.max_size):
            with self._cond:
                due = [s for s in self._idle if time.monotonic() - s.checked_at >= max_age]
                if self._closed or not due:
                    break
                slot = due[0]
                self._idle.remove(slot)
                self._busy += 1
            try:
                ok = slot.sandbox.exec(["true"], timeout=_HEALTH_TIMEOUT_S).ok
                reason = "" if ok else "`true` failed"
            except Exception as err:  # a broken sandbox raises; it is replaced, never handed out
                ok, reason = False, str(err)
            slot.checked_at = time.monotonic()
            if ok:
                self._put_idle(slot)
            else:
                broken += 1
                self._count_failure("unhealthy", f"sandbox {slot.sandbox.sandbox_id} is unhealthy: {reason}")
                self._destroy(slot)
        return broken

    def fill_warm(self) -> int:
        """Create sandboxes until ``min_warm`` are idle (within max_size); returns how many were made."""
        made = 0
        while True:
            with self._cond:
                live = len(self._idle) + len(self._leases) + self._busy
                if self._closed or len(self._idle) >= self.config.min_warm or live >= self.config.max_size:
                    return made
                self._busy += 1
            try:
                slot = _Slot(self._factory())
            except Exception as err:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
                self._count_failure("create_failures", f"creating a warm sandbox failed: {err}")
                return made
            with self._cond:
                self._counts["created"] += 1
            self._put_idle(slot)
            made += 1

    def maintain(self) -> dict[str, int]:
        """One round of upkeep: expire leases, health-check idle sandboxes, refill the warm pool."""
        expired = self.expire_leases()
        unhealthy = self.health_check()
        return {"expired": expired, "unhealthy": unhealthy, "created": self.fill_warm()}

    def shutdown(self) -> None:
        """Close every sandbox (leased ones too); waiters get PoolClosed. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            slots = list(self._idle) + [slot for _, slot in self._leases.values()]
            self._idle.clear()
            self._leases.clear()
            self._busy += len(slots)
            self._cond.notify_all()
        for slot in slots:
            self._destroy(slot)

    # --------------------------------------------------------------------------------------- metrics
    def record_acquire_latency(self, seconds: float) -> None:
        """Add one successful acquire's wait to the latency histogram."""
        with self._cond:
            index = next((i for i, b in enumerate(LATENCY_BUCKETS_S) if seconds <= b), len(LATENCY_BUCKETS_S))
            self._latency_buckets[index] += 1
            self._latency_sum += seconds
            self._latency_max = max(self._latency_max, seconds)
            self._latencies.append(seconds)

    def exhausted(self, waited_s: float) -> PoolExhausted:
        """Count a timed-out acquire and build its error (the caller raises it)."""
        with self._cond:
            return self._exhausted_locked(waited_s)

    def gauges(self) -> dict[str, int]:
        """The few numbers the metrics exporter needs, without copying the latency history."""
        with self._cond:
            return {"warm": len(self._idle), "leased": len(self._leases),
                    "failures": self._counts["failures"], "reclaimed": self._counts["reclaimed"]}

    def stats(self) -> dict[str, Any]:
        """Current gauges, lifetime counters and the acquire-latency histogram."""
        with self._cond:
            count = sum(self._latency_buckets)
            return {
                "warm": len(self._idle),
                "leased": len(self._leases),
                "busy": self._busy,
                "live": len(self._idle) + len(self._leases) + self._busy,
                "max_size": self.config.max_size,
                "closed": self._closed,
                **self._counts,
                "acquire_latency": {
                    "count": count,
                    "sum_s": self._latency_sum,
                    "max_s": self._latency_max,
                    "mean_s": self._latency_sum / count if count else 0.0,
                    "buckets": {**{str(b): n for b, n in zip(LATENCY_BUCKETS_S, self._latency_buckets)},
                                "+Inf": self._latency_buckets[-1]},
                    "recent_s": list(self._latencies),
                },
            }

    # ------------------------------------------------------------------------------------- internals
    def _take_locked(self) -> tuple[_Slot | None, bool]:
        """An idle slot, or a reservation to create one (True), or neither (the pool is full)."""
        if self._closed:
            raise PoolClosed("the sandbox pool is shut down")
        if self._idle:
            slot = self._idle.popleft()
            self._busy += 1
            return slot, False
        if len(self._idle) + len(self._leases) + self._busy < self.config.max_size:
            self._busy += 1
            return None, True
        return None, False

    def _create_reserved(self) -> _Slot:
        try:
            sandbox = self._factory()
        except Exception as err:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
            self._count_failure("create_failures", f"creating a sandbox failed: {err}")
            raise SandboxError(f"creating a sandbox failed: {err}") from err
        with self._cond:
            self._counts["created"] += 1
        return _Slot(sandbox)

    def _grant(self, slot: _Slot, owner: str, lease_s: float | None) -> Lease:
        """Turn a taken slot (counted busy) into a lease."""
        lease_id, slot.next_lease = slot.next_lease, None
        duration = self.config.lease_s if lease_s is None else float(lease_s)
        try:
            if lease_id is None:
                lease_id = _new_lease_id()
                slot.sandbox.set_lease(lease_id)
            handle = slot.sandbox.handle()
        except Exception as err:
            self._count_failure("failures",
                                f"sandbox {slot.sandbox.sandbox_id}: granting a lease failed: {err}")
            self._destroy(slot)
            raise SandboxError(f"granting a sandbox lease failed: {err}") from err
        lease = Lease(lease_id=lease_id, handle=handle, owner=owner, expires_at=time.time() + duration)
        with self._cond:
            self._busy -= 1
            if self._closed:
                self._busy += 1
                closed = True
            else:
                self._leases[lease_id] = (lease, slot)
                self._counts["leases_granted"] += 1
                closed = False
        if closed:
            self._destroy(slot)
            raise PoolClosed("the sandbox pool is shut down")
        return lease

    def _return(self, slot: _Slot) -> None:
        """A slot (counted busy) comes back from a lease: reset it, or recycle it when it is worn out."""
        slot.uses += 1
        if self._closed:
            self._destroy(slot)
            return
        if slot.uses >= self.config.recycle_after:
            with self._cond:
                self._counts["recycled"] += 1
            self._destroy(slot)
            return
        try:
            slot.next_lease = None
            slot.sandbox.set_lease(None)
            slot.sandbox.reset()
        except Exception as err:
            self._count_failure("reset_failures", f"sandbox {slot.sandbox.sandbox_id}: reset failed: {err}")
            self._destroy(slot)
            return
        slot.checked_at = time.monotonic()
        self._put_idle(slot)

    def _put_idle(self, slot: _Slot) -> None:
        """A slot (counted busy) becomes idle, its next lease id already fenced in (see _Slot)."""
        if slot.next_lease is None:
            lease_id = _new_lease_id()
            try:
                slot.sandbox.set_lease(lease_id)
            except Exception as err:
                self._count_failure("failures", f"sandbox {slot.sandbox.sandbox_id}: fencing failed: {err}")
                self._destroy(slot)
                return
            slot.next_lease = lease_id
        with self._cond:
            self._busy -= 1
            if not self._closed:
                self._idle.append(slot)
                self._cond.notify_all()
                return
            self._busy += 1
        self._destroy(slot)

    def _destroy(self, slot: _Slot) -> None:
        """Close a slot (counted busy) and forget it."""
        try:
            slot.sandbox.set_lease(None)
        except Exception:
            pass  # closing below kills everything regardless of the fence
        try:
            slot.sandbox.close()
        except Exception as err:
            self._count_failure("close_failures", f"sandbox {slot.sandbox.sandbox_id}: close failed: {err}")
        with self._cond:
            self._busy -= 1
            self._counts["destroyed"] += 1
            self._cond.notify_all()

    def _count_failure(self, kind: str, message: str) -> None:
        with self._cond:
            self._counts[kind] += 1
            if kind != "failures":
                self._counts["failures"] += 1
        logger.warning("%s", message)

    def _exhausted_locked(self, waited_s: float) -> PoolExhausted:
        self._counts["exhausted"] += 1
        return PoolExhausted(
            f"no sandbox became free within {waited_s:.1f} s: {len(self._leases)} leased, {self._busy} busy "
            f"(creating/resetting), max_size={self.config.max_size}. Raise sandbox_pool.max_size or "
            "sandbox_pool.acquire_timeout_s, or lower rollout concurrency"
        )

    def _until_next_expiry_locked(self) -> float:
        if not self._leases:
            return _MAX_WAIT_TICK_S
        soonest = min(lease.expires_at for lease, _ in self._leases.values())
        return max(0.01, min(_MAX_WAIT_TICK_S, soonest - time.time()))
