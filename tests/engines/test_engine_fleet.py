"""EngineActor and EngineFleet in a real local Ray over real CPU engine servers (tiny model).

Both engines start together; control calls reach each server and are logged there in order; an engine
whose actor is killed takes its server with it and is replaced in its seat; an engine whose server dies
is replaced too; a replacement is not live until it is marked so; shutdown leaves no server behind.
Engines sweep the weight buffers a killed process left in /dev/shm as they start. A replacement whose
bundle Ray cannot place (as when its node died and no spare node has come) is not started until Ray
places it: one death is one restart, never a failed start, and shutdown does not wait for it.
tests/multinode/test_multinode.py kills a whole node for the same.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from actors.engine import EngineSeat  # noqa: E402
from actors.engine_fleet import EngineFleet  # noqa: E402
from rayrl.config import EngineConfig  # noqa: E402
from rayrl.engines.client import EngineClient  # noqa: E402
from tests.shm_support import left_by_a_killed_owner  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    # "seat_*": one unit each, so a placement group can be made unplaceable by another holding it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, resources={"seat_a": 1, "seat_b": 1})
    yield
    ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(predicate, timeout_s: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _generate(url: str) -> str:
    async def go():
        client = EngineClient(url)
        try:
            out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})
            return out.weight_version
        finally:
            await client.close()

    return asyncio.run(go())


# ~60 s; fast: test_schedule_phases.py::test_an_engine_that_dies_leaves_the_routers_and_returns_only_with_the_
# current_weights (the membership rules), tests/gateway/test_engine_loss.py (a call survives the death)
@pytest.mark.slow
def test_fleet_starts_controls_and_replaces_engines(ray_local, tiny_model, tmp_path):
    cfg = EngineConfig(backend="cpu", num_engines=2, dtype="float32", max_batch_size=4, context_length=256,
                       num_threads=1)
    with left_by_a_killed_owner() as (buffer, weights):  # weight buffers of a process killed with SIGKILL
        fleet = EngineFleet(cfg, str(tiny_model), str(tmp_path / "logs"), [None, None], name_prefix="fleet-test")
        assert not buffer.exists() and not weights.exists()  # the engines swept them as they started
    blockers = [placement_group([{r: 1}]) for r in ("seat_a", "seat_b")]
    groups = [placement_group([{r: 1}]) for r in ("seat_a", "seat_b")]  # pending while a blocker holds r
    try:
        infos = fleet.infos()
        assert [i["index"] for i in infos] == [0, 1] and len(set(fleet.urls)) == 2
        assert all(i["state"] == "live" and i["node_id"] == ray.get_runtime_context().get_node_id() for i in infos)
        assert all(_generate(u) == "0" for u in fleet.urls)  # every engine serves

        fleet.pause_generation("in_place")
        fleet.wait_idle()  # /flush_cache until it succeeds (nothing is running: at once)
        fleet.release_memory_occupation()
        fleet.resume_memory_occupation()
        fleet.continue_generation()
        logs = ray.get([s.actor.control_log.remote() for s in fleet.slots])
        assert logs == [["pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
                         "continue_generation"]] * 2

        # the actor killed: its server goes with it, and a new engine starts in the same seat
        old_url, old_pid = fleet.slots[1].url, fleet.slots[1].info["pid"]
        ray.kill(fleet.slots[1].actor)
        events: list = []
        _wait(lambda: events.extend(fleet.poll()) or any(e.kind == "down" for e in events), what="down event")
        down = next(e for e in events if e.kind == "down")
        assert down.index == 1 and down.url == old_url and "actor died" in down.detail
        _wait(lambda: not _alive(old_pid), 30, "the killed actor's server to exit")
        assert fleet.urls == [fleet.slots[0].url]  # not live until it has weights
        _wait(lambda: events.extend(fleet.poll()) or any(e.kind == "started" for e in events), what="restart")
        assert fleet.slots[1].state == "joining" and fleet.slots[1].restarts == 1
        assert [e.url for e in fleet.endpoints()] == [fleet.slots[0].url, fleet.slots[1].url]
        fleet.mark_live(1)
        assert len(fleet.urls) == 2 and _generate(fleet.slots[1].url) == "0"

        # the server dies under a live actor: watch() returns, the engine is replaced the same way
        pid, log = fleet.slots[0].info["pid"], fleet.slots[0].info["log_path"]
        os.killpg(pid, signal.SIGKILL)
        events = []
        _wait(lambda: events.extend(fleet.poll()) or any(e.kind == "started" for e in events), what="restart 0")
        down = next(e for e in events if e.kind == "down")
        assert down.index == 0 and down.detail == f"server exited with code -9; its log: {log}"
        fleet.mark_live(0)
        assert fleet.slots[0].info["pid"] != pid and all(_generate(u) == "0" for u in fleet.urls)
        assert [s.restarts for s in fleet.slots] == [1, 1] and [s.failed_starts for s in fleet.slots] == [0, 0]

        # an engine whose bundle Ray cannot place (as when its node died and no spare node has come): nothing
        # starts, nothing fails, until Ray places it; shutdown does not wait for it
        ray.get([b.ready() for b in blockers])
        for slot, group in zip(fleet.slots, groups):  # their next engine goes on a bundle Ray cannot place
            slot.seat = EngineSeat(group, (0,), 0.0)
        ray.kill(fleet.slots[1].actor)
        events = []
        _wait_for(fleet, "down", events)
        for _ in range(30):
            events += fleet.poll()
            time.sleep(0.1)
        slot = fleet.slots[1]
        assert [e.kind for e in events] == ["down"] and slot.state == "down" and slot.start_ref is None
        assert slot.restarts == 2 and slot.failed_starts == 0
        remove_placement_group(blockers[1])  # the bundle is placed (a spare node came): the engine starts
        _wait_for(fleet, "started", events)
        assert slot.state == "joining" and slot.info["bundles"] == [0]
        assert slot.restarts == 2 and slot.failed_starts == 0 and [e.kind for e in events] == ["down", "started"]
        fleet.mark_live(1)
        assert _generate(slot.url) == "0"
        ray.kill(fleet.slots[0].actor)  # its bundle can never be placed while the test lasts
        _wait_for(fleet, "down", events)
    finally:
        pids = [s.info["pid"] for s in fleet.slots]
        fleet.shutdown(timeout_s=3600)  # returns at once: it stops the engines that are up, kills the rest
        for group in [*groups, blockers[0]]:
            remove_placement_group(group)
    for pid in pids:
        _wait(lambda pid=pid: not _alive(pid), 30, f"server {pid} to exit")


def _wait_for(fleet: EngineFleet, kind: str, events: list) -> None:
    _wait(lambda: events.extend(fleet.poll()) or any(e.kind == kind for e in events), what=f"a {kind} event")

