"""Fault injection in the dispatch, with real Ray actors and real processes (tiny model, async schedule).

1. a rollout worker actor killed mid-episode: its episodes are re-queued (not lost, not counted twice);
2. the engine actor killed mid-step (its server goes with it): a new one starts on its bundle and gets
   the newest weights before it takes traffic; LLM calls made meanwhile wait at the gateway, and a
   generation it was running is continued on the new engine, so no episode is lost or counted twice;
3. a weight transfer that hangs (engine process stopped with SIGSTOP): a clear error within
   ``pipeline.weight_sync_timeout_s`` instead of a hung run.
Each failure is counted once. The tests share one pipeline and run in file order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from tests.pipeline.run_config import ROOT, engine_version, pipeline_config, step_episodes

# ~2.5 min for the module (one pipeline shared by its faults); fast: test_schedule_phases (engine membership,
# reruns), engines/test_router_engine_loss and gateway/test_engine_loss (an engine killed mid-call)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir, tmp_path_factory):
    from actors.pipeline import Pipeline

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    tmp = Path(tmp_path_factory.mktemp("faults"))
    cfg = pipeline_config(tmp, tiny_model_dir, "exp_id=faults", "pipeline.schedule=async",
                          "pipeline.max_staleness=4", "pipeline.groups_in_flight=4", "pipeline.weight_sync_timeout_s=5",
                          "trainer.steps=8")
    pipe = Pipeline(cfg)
    yield pipe
    pipe.shutdown()
    ray.shutdown()


def _after(delay_s: float, predicate, action) -> threading.Thread:
    """Run ``action`` once ``predicate`` holds, ``delay_s`` later (from a helper thread)."""

    def target() -> None:
        deadline = time.monotonic() + 60
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay_s)
        action()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_rollout_worker_killed_mid_episode_requeues_its_episodes(pipeline):
    victim = pipeline.workers[0]
    # kill once episodes are running and inside their sandbox work (first LLM call done)
    killer = _after(0.8, lambda: len(pipeline.dispatcher.running) >= 2, lambda: ray.kill(victim))
    metrics = pipeline.run_step()
    killer.join(5)
    assert pipeline.workers[0] != victim  # replaced
    assert metrics["failures/rollout_worker_deaths"] == 1  # counted once, however many episodes it had
    assert metrics["failures/episodes_requeued"] >= 1
    rows = step_episodes(pipeline.cfg, pipeline.step)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)  # none lost
    assert len({(r["group_id"], r["index"]) for r in rows}) == 4  # none counted twice


def test_engine_killed_mid_step_is_restarted(pipeline):
    slot = pipeline.engines.slots[0]
    old_actor, old_pid = slot.actor, slot.info["pid"]
    killer = _after(0.5, lambda: len(pipeline.dispatcher.running) >= 2, lambda: ray.kill(old_actor))
    step_before = pipeline.step
    history = [pipeline.run_step()]
    # the run goes on; within a few steps the new engine has rejoined and served a whole step
    while pipeline.failure_counts["engine_restarts"] == 0 or slot.state != "live" or len(history) < 2:
        assert len(history) < 6, history
        history.append(pipeline.run_step())
    killer.join(5)
    metrics = history[-1]
    assert pipeline.failure_counts["engine_restarts"] == 1 and slot.restarts == 1
    assert metrics["failures/engine_restarts"] == 1
    assert slot.info["pid"] != old_pid and pipeline.engine_urls == [slot.url]
    with pytest.raises(ProcessLookupError):  # the killed actor's server went with it
        os.kill(old_pid, 0)
    # every episode is accounted for and none failed: the generation the engine was running continued on
    # the new engine; calls made while it was down waited at the gateway
    for step in range(step_before + 1, pipeline.step + 1):
        rows = step_episodes(pipeline.cfg, step)
        assert len(rows) == 4 and len({(r["group_id"], r["index"]) for r in rows}) == 4
        assert all(r["status"] == "ok" for r in rows), rows
    assert metrics["gateway/engine_waits"] + metrics["gateway/reconnect_waits"] >= 1
    # the new engine got the newest weights back
    assert engine_version(pipeline.engine_urls[0]) == str(pipeline.version)


def test_hung_weight_transfer_times_out_with_a_clear_error(pipeline):
    from actors.pipeline import WeightSyncError

    pid = pipeline.engines.slots[0].info["pid"]
    os.kill(pid, signal.SIGSTOP)  # the engine accepts connections but never answers
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"weight_sync_timeout_s=5 s: .*no answer"):
            pipeline.schedule.membership.push_weights(pipeline.version)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - started < 40
    assert pipeline.failure_counts["weight_sync_failures"] == 1
