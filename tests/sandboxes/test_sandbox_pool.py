"""SandboxPool with real (bwrap-isolated) sandboxes: leasing under concurrency, expiry, reclaim, recycle,
health, backpressure."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest
from sbtest_helpers import processes_matching

from rayrl.config import SandboxConfig, SandboxPoolConfig
from rayrl.sandboxes import SandboxError, open_sandbox
from rayrl.sandboxes.local import LocalSandbox
from rayrl.sandboxes.pool import PoolClosed, PoolExhausted, SandboxPool


@pytest.fixture
def make_pool(sandbox_root):
    pools: list[SandboxPool] = []

    def make(**fields) -> SandboxPool:
        sandbox_config = SandboxConfig(isolation="bwrap", files={"calc.py": "print(2 + 2)\n"})
        pool = SandboxPool(sandbox_config, SandboxPoolConfig(**fields),
                           factory=lambda: LocalSandbox(sandbox_config, root=sandbox_root))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


def test_concurrent_leases_are_exclusive_and_none_is_lost(make_pool):
    pool = make_pool(min_warm=2, max_size=4, acquire_timeout_s=60, recycle_after=1000)
    assert pool.fill_warm() == 2
    holders: dict[str, str] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    per_thread, threads = 8, 12

    def worker(name: str) -> None:
        try:
            for i in range(per_thread):
                lease = pool.acquire(owner=name)
                sid = lease.handle.sandbox_id
                with lock:
                    assert sid not in holders, f"{sid} leased to {holders.get(sid)} and {name}"
                    holders[sid] = name
                sb = open_sandbox(lease.handle)
                with pytest.raises(FileNotFoundError):
                    sb.read_file("owner.txt")  # every lease starts from a fresh working directory
                sb.write_file("owner.txt", f"{name}/{i}".encode())
                time.sleep(0.002)
                assert sb.read_file("owner.txt") == f"{name}/{i}".encode()
                assert sb.read_file("calc.py") == b"print(2 + 2)\n"  # preloaded again after reset
                with lock:
                    del holders[sid]
                assert pool.release(lease.lease_id)
        except BaseException as err:
            errors.append(err)

    ts = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors[:3]
    s = pool.stats()
    total = per_thread * threads
    assert s["leases_granted"] == total and s["released"] == total
    assert s["leased"] == 0 and s["busy"] == 0 and s["failures"] == 0
    assert s["created"] <= 4 and s["live"] == s["warm"] == s["created"] - s["destroyed"]
    assert s["acquire_latency"]["count"] == total
    assert sum(s["acquire_latency"]["buckets"].values()) == total


def test_a_leased_sandbox_runs_commands(make_pool):
    pool = make_pool(min_warm=1, max_size=2)
    lease = pool.acquire("w")
    sb = open_sandbox(lease.handle)
    assert sb.exec(["python3", "calc.py"]).stdout == "4\n"
    assert lease.expires_at > time.time() + 500
    pool.release(lease.lease_id)


def test_exhaustion_is_a_clear_error_and_release_wakes_waiters(make_pool):
    pool = make_pool(min_warm=0, max_size=1)
    first = pool.acquire("w1")
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted, match="no sandbox became free within 0.3 s.*max_size=1"):
        pool.acquire("w2", timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2
    assert pool.stats()["exhausted"] == 1
    threading.Timer(0.2, pool.release, args=(first.lease_id,)).start()
    t0 = time.monotonic()
    second = pool.acquire("w2", timeout=5)
    assert time.monotonic() - t0 < 2 and second.handle.sandbox_id == first.handle.sandbox_id
    assert pool.try_acquire("w3") is None


def test_expired_lease_is_reclaimed_and_fenced(make_pool):
    pool = make_pool(min_warm=0, max_size=1)
    lease = pool.acquire("slow-worker", lease_s=0.3)
    sb = open_sandbox(lease.handle)
    sb.write_file("work.txt", b"in progress")
    time.sleep(0.4)
    assert pool.expire_leases() == 1
    with pytest.raises(SandboxError, match="lease"):
        sb.exec("true")  # the late worker can no longer touch the sandbox
    assert pool.release(lease.lease_id) is False  # a stale release is counted, not an error
    s = pool.stats()
    assert (s["expired"], s["reclaimed"], s["stale_releases"], s["leased"]) == (1, 1, 1, 0)
    nxt = pool.acquire("next", timeout=1)
    with pytest.raises(FileNotFoundError):
        open_sandbox(nxt.handle).read_file("work.txt")


def test_waiter_gets_a_sandbox_when_a_lease_expires(make_pool):
    pool = make_pool(min_warm=0, max_size=1)
    pool.acquire("stuck", lease_s=0.3)
    t0 = time.monotonic()
    pool.acquire("waiter", timeout=5)
    assert 0.25 <= time.monotonic() - t0 < 2.5


def test_reclaim_owner(make_pool):
    pool = make_pool(min_warm=0, max_size=3)
    a, b, c = pool.acquire("dead"), pool.acquire("dead"), pool.acquire("alive")
    assert pool.owners() == {"dead", "alive"}
    assert pool.reclaim_owner("dead") == 2
    s = pool.stats()
    assert s["leased"] == 1 and s["owner_reclaimed"] == 2 and s["warm"] == 2
    assert pool.release(c.lease_id) and not pool.release(a.lease_id) and not pool.release(b.lease_id)


def test_release_kills_what_the_lease_left_running(make_pool):
    pool = make_pool(min_warm=0, max_size=1)
    lease = pool.acquire("w")
    sb = open_sandbox(lease.handle)
    errors = []

    def run() -> None:
        try:
            sb.exec("sleep 987641", timeout=60)
        except SandboxError as err:
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    for _ in range(250):
        if processes_matching("sleep\x00987641"):
            break
        time.sleep(0.02)
    t0 = time.monotonic()
    pool.release(lease.lease_id)
    worker.join(10)
    assert not worker.is_alive() and time.monotonic() - t0 < 5
    assert "lease" in str(errors[0])  # the late command learns why it died
    assert processes_matching("987641") == []


def test_recycle_after_n_leases(make_pool):
    pool = make_pool(min_warm=0, max_size=1, recycle_after=2)
    ids = []
    for _ in range(4):
        lease = pool.acquire("w")
        ids.append(lease.handle.sandbox_id)
        pool.release(lease.lease_id)
    assert ids[0] == ids[1] != ids[2] == ids[3]
    s = pool.stats()
    assert s["recycled"] == 2 and s["created"] == 2 and s["destroyed"] == 2


def test_health_check_replaces_a_broken_sandbox(make_pool):
    pool = make_pool(min_warm=1, max_size=2)
    pool.fill_warm()
    lease = pool.acquire("w")
    broken_root = lease.handle.root
    pool.release(lease.lease_id)
    os.rename(os.path.join(broken_root, "work"), os.path.join(broken_root, "work-gone"))  # break it
    assert pool.health_check(max_age_s=0) == 1
    s = pool.stats()
    assert s["unhealthy"] == 1 and s["failures"] == 1 and s["warm"] == 0
    assert pool.fill_warm() == 1
    assert open_sandbox(pool.acquire("w").handle).exec("true").ok


def test_create_failure_is_counted_and_raised(sandbox_root):
    calls = Counter()

    def failing_factory():
        calls["n"] += 1
        return LocalSandbox(SandboxConfig(isolation="no-such-level"), root=sandbox_root)

    pool = SandboxPool(SandboxConfig(), SandboxPoolConfig(min_warm=0, max_size=1), factory=failing_factory)
    with pytest.raises(SandboxError, match="creating a sandbox failed"):
        pool.acquire("w", timeout=1)
    s = pool.stats()
    assert s["create_failures"] == 1 and s["failures"] == 1 and s["busy"] == 0
    pool.shutdown()


def test_shutdown_closes_everything(make_pool):
    pool = make_pool(min_warm=1, max_size=2)
    pool.fill_warm()
    lease = pool.acquire("w")
    pool.shutdown()
    assert not os.path.exists(lease.handle.root)
    with pytest.raises(PoolClosed):
        pool.acquire("w", timeout=1)
    assert pool.stats()["live"] == 0


def test_sandbox_destroyed_mid_lease_fails_its_user_and_is_replaced(make_pool):
    """A sandbox that dies under an episode fails that episode (SandboxError, not a command's exit code);
    on release the pool drops it and the next lease gets a working sandbox."""
    import shutil

    pool = make_pool(min_warm=1, max_size=1)
    pool.fill_warm()
    lease = pool.acquire("w")
    sb = open_sandbox(lease.handle)
    shutil.rmtree(lease.handle.root)
    with pytest.raises(SandboxError, match="is gone"):
        sb.exec("true", timeout=10)
    with pytest.raises(SandboxError, match="is gone"):
        sb.write_file("x.txt", b"1")
    pool.release(lease.lease_id)
    fresh = pool.acquire("w", timeout=30)
    assert fresh.handle.sandbox_id != lease.handle.sandbox_id
    assert open_sandbox(fresh.handle).exec("true").ok
    assert pool.stats()["failures"] >= 1
