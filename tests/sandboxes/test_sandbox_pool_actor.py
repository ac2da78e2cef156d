"""SandboxPoolActor on a real local Ray: a worker actor leases and uses a sandbox, then dies; the pool
reclaims its lease. Also backpressure and stats through Ray."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray")

from actors.sandbox_pool import SandboxPoolActor  # noqa: E402
from rayrl.config import SandboxConfig, SandboxPoolConfig  # noqa: E402
from rayrl.sandboxes import open_sandbox  # noqa: E402
from rayrl.sandboxes.pool import PoolExhausted  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test file is not importable there
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class EpisodeWorker:
    """Stands in for a rollout worker: leases with its own actor id as owner and uses the sandbox locally."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def hold_sandbox(self) -> tuple[str, str]:
        owner = ray.get_runtime_context().get_actor_id()
        lease = ray.get(self.pool.acquire.remote(owner, None, 20))
        sb = open_sandbox(lease.handle)
        sb.write_file("expr.txt", b"6*7")
        result = sb.exec(["python3", "-c", "print(eval(open('expr.txt').read()))"], timeout=10)
        return lease.lease_id, result.stdout


def test_pool_actor_leases_reclaims_dead_owners_and_applies_backpressure(ray_local):
    pool = SandboxPoolActor.remote(
        SandboxConfig(isolation="bwrap"),
        SandboxPoolConfig(min_warm=1, max_size=2, acquire_timeout_s=5, health_interval_s=0.5),
        tick_s=0.2,
    )
    worker = EpisodeWorker.remote(pool)
    lease_id, out = ray.get(worker.hold_sandbox.remote(), timeout=60)
    assert out == "42\n"
    assert ray.get(pool.stats.remote())["leased"] == 1

    ray.kill(worker)  # the owner dies holding its lease: upkeep must notice and reclaim it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = ray.get(pool.stats.remote())
        if s["owner_reclaimed"] == 1 and s["leased"] == 0:
            break
        time.sleep(0.2)
    assert s["owner_reclaimed"] == 1 and s["leased"] == 0, s
    assert ray.get(pool.release.remote(lease_id)) is False  # already reclaimed

    a = ray.get(pool.acquire.remote("driver"))
    b = ray.get(pool.acquire.remote("driver"))
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted, match="max_size=2"):
        ray.get(pool.acquire.remote("driver", None, 0.3))
    assert time.monotonic() - t0 < 5
    waiter = pool.acquire.remote("driver", None, 10)  # waits asynchronously, woken by the release
    time.sleep(0.3)
    assert ray.get(pool.release.remote(a.lease_id)) is True
    c = ray.get(waiter, timeout=10)
    assert c.handle.sandbox_id == a.handle.sandbox_id
    s = ray.get(pool.stats.remote())
    assert s["exhausted"] == 1 and s["leased"] == 2 and s["failures"] == 0
    assert s["acquire_latency"]["count"] == 4
    final = ray.get(pool.shutdown.remote())
    assert final["live"] == 0 and final["closed"]
    del b, c


def test_warm_makes_min_warm_sandboxes_before_any_lease(ray_local):
    """The run's start warms the pool while the engines and trainer load, so the first episodes lease warm
    sandboxes instead of each making its own."""
    pool = SandboxPoolActor.remote(SandboxConfig(isolation="bwrap"),
                                   SandboxPoolConfig(min_warm=3, max_size=4, health_interval_s=30), tick_s=30)
    try:
        assert ray.get(pool.warm.remote(), timeout=60) == 3
        stats = ray.get(pool.stats.remote())
        assert stats["warm"] == 3 and stats["leased"] == 0
        lease = ray.get(pool.acquire.remote("driver", None, 5))
        assert ray.get(pool.stats.remote())["leased"] == 1 and lease.lease_id
    finally:
        ray.get(pool.shutdown.remote())
        ray.kill(pool)
