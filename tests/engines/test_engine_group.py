"""EngineGroup as a real Ray actor over two real CPU engine servers."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from actors.engine import EngineGroup  # noqa: E402
from rayrl.config import EngineConfig  # noqa: E402
from rayrl.engines.client import EngineClient  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_engine_group_lifecycle(ray_local, tiny_model, tmp_path):
    cfg = EngineConfig(
        backend="cpu", num_engines=2, dtype="float32", max_batch_size=4, context_length=256, num_threads=1
    )
    group = EngineGroup.remote(cfg, str(tiny_model), str(tmp_path / "logs"))
    try:
        urls = ray.get(group.urls.remote(), timeout=120)
        assert len(urls) == 2 and len(set(urls)) == 2
        assert ray.get(group.health.remote()) == [True, True]

        results = ray.get(group.update_weights_from_disk.remote(str(tiny_model), "5"))
        assert all(r["success"] for r in results)

        async def versions():
            clients = [EngineClient(u) for u in urls]
            out = [await c.get_weight_version() for c in clients]
            gen = await clients[0].generate([1, 2], {"max_new_tokens": 2, "temperature": 0})
            for c in clients:
                await c.close()
            return out, gen

        out, gen = asyncio.run(versions())
        assert out == ["5", "5"] and gen.weight_version == "5"
        ray.get(group.pause_generation.remote("in_place"))
        ray.get(group.release_memory_occupation.remote(None))
        ray.get(group.resume_memory_occupation.remote(["weights"]))
        ray.get(group.continue_generation.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match="failed"):
            ray.get(group.update_weights_from_disk.remote("/no/such/checkpoint", "6"))

        # a dead engine is restarted on the same URL
        pids = ray.get(group.pids.remote())
        os.killpg(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while ray.get(group.health.remote())[1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.get(group.restart_dead.remote(), timeout=120) == [urls[1]]
        assert ray.get(group.health.remote()) == [True, True]
        assert ray.get(group.urls.remote()) == urls
    finally:
        ray.get(group.shutdown.remote(), timeout=60)
    for pid in ray.get(group.pids.remote()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
