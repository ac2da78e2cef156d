"""Every schedule's phase order, the rerun and drop rules, the engine membership and the way back after a
trainer failure, driven with plain fakes in milliseconds (rayrl/orchestration/, no Ray).

The fakes (schedule_fakes.py) keep the Ray shells' contracts as the schedules see them and the GPU's
memory rules; each writes what it is asked to one shared log, so a test reads the exact order of calls
across trainer, engines, weights and gateway. The whole-pipeline runs (tests/pipeline/test_schedules_e2e.py)
check the same orders on the real parts.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from rayrl.checkpoint import CheckpointStore
from rayrl.orchestration.part_failures import TrainerFailure, WeightSyncError
from rayrl.orchestration.run_checkpoint import RunCheckpoints
from rayrl.rl.batch import build_batch
from rayrl.rl.failures import AGENT_CRASHED, ENGINE_ERROR
from rayrl.rl.groups import Group
from rayrl.types import Episode
from tests.orchestration.schedule_fakes import (
    STARTED_ON,
    Run,
    _episode,
    make_run,
    scored_by_index,
)

# -- the phase order of every schedule ---------------------------------------------------------------


def test_sync_trains_with_nothing_running_then_pushes_to_every_engine():
    run = make_run("pipeline.schedule=sync")
    for step in (1, 2):
        mark = len(run.log)
        groups, train = run.step()
        assert [g.task.task_id for g in groups] == [f"t{2 * step - 2}", f"t{2 * step - 1}"]
        assert all(STARTED_ON[g.group_id] == step - 1 for g in groups)  # each started on the current weights
        assert run.log.since(mark) == ["trainer.train(4)", f"weights.push({step} -> 2)"]
        assert train["train/policy_version"] == step and "time/weight_sync_s" in train
    assert run.state.version == 2 and run.dispatcher.groups_in_flight == 0  # sync queues only what it takes


def test_async_updates_the_engines_with_nothing_generating_and_calls_held_at_the_gateway():
    run = make_run("pipeline.schedule=async", "pipeline.groups_in_flight=4", "pipeline.max_staleness=1")
    for step in (1, 2):
        mark = len(run.log)
        run.step()
        assert run.log.since(mark) == [
            "trainer.train(4)", "gateway.hold_llm_calls", "engines.pause_generation(abort)",
            "engines.wait_idle", f"weights.push({step} -> 2)", "engines.continue_generation",
            "gateway.release_llm_calls"]
    assert run.dispatcher.groups_in_flight >= 2  # rollout ran ahead while the trainer trained


def test_async_releases_held_calls_when_the_weight_update_fails():
    run = make_run("pipeline.schedule=async")
    run.weights.fail_push = 1
    with pytest.raises(WeightSyncError, match="on purpose"):
        run.step()
    assert run.log[-2:] == ["weights.push(1 -> 2)", "gateway.release_llm_calls"]  # no call waits for ever


@pytest.mark.parametrize("partial_rollout, drained, mode", [(True, True, "abort"), (False, True, "in_place"),
                                                            (False, False, "abort")])
def test_colocated_async_follows_the_gpu_order(partial_rollout, drained, mode):
    """Issue 25: train -> engines resume weights -> push from live memory -> release the broadcast group
    -> trainer offload -> engines resume kv_cache and cuda_graph -> continue; the devices go to the
    trainer only after the gateway holds calls and the engines paused (drained, or aborted after the
    wait) and released their memory."""
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1",
                   f"pipeline.partial_rollout={str(partial_rollout).lower()}")
    run.gateway.drained = drained
    # built: the engines take the devices back as after a step, the trainer's weights pushed first
    assert run.log == ["engines.resume_memory_occupation(weights)", "weights.push(0 -> 2)", "weights.release_groups",
                       "trainer.offload", "engines.resume_memory_occupation(kv_cache,cuda_graph)"]
    for step in (1, 2):
        mark = len(run.log)
        _, train = run.step()
        give = ["gateway.hold_llm_calls", *([] if partial_rollout else ["gateway.drain"]),
                f"engines.pause_generation({mode})", "engines.wait_idle", "engines.release_memory_occupation",
                "trainer.onload"]
        back = ["engines.resume_memory_occupation(weights)", f"weights.push({step} -> 2)",
                "weights.release_groups", "trainer.offload",
                "engines.resume_memory_occupation(kv_cache,cuda_graph)",
                "engines.continue_generation", "gateway.release_llm_calls"]
        assert run.log.since(mark) == [*give, "trainer.train(4)", *back]
        assert {"time/engine_pause_s", "time/weight_sync_s", "gateway/queue_depth"} <= set(train)
    assert run.state.failures["drain_timeouts"] == (0 if drained or partial_rollout else 2)
    assert not run.schedule.devices_with_trainer


def test_colocated_async_engines_serve_the_trainers_weights_from_the_first_rollout():
    """Issue 41 B: the engines released their memory while the trainer was built; SGLang resumes the
    weights region without its contents (no CPU backup by default), so the trainer's weights are pushed
    before any episode reaches an engine (the fake dispatcher fails a rollout on lost weights)."""
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")
    log = run.log
    assert log.index("weights.push(0 -> 2)") < log.index("engines.resume_memory_occupation(kv_cache,cuda_graph)")
    assert not any(s.released or s.weights_lost for s in run.engines.slots) and run.trainer.offloaded
    groups, train = run.step()
    assert groups and train["train/policy_version"] == 1


def test_colocated_async_saves_and_loads_checkpoints_with_the_trainer_onloaded(tmp_path):
    """Issue 41 C and D: outside its train phase the colocated trainer is offloaded; a checkpoint save
    (every step, and at the end) and a resume's load take the devices for it and give them back with the
    trainer's weights pushed (a load changed them); nothing reads the trainer while it is offloaded."""
    overrides = ("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")
    run = make_run(*overrides)
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1, save_every=10)
    mark = len(run.log)
    checkpoints.save(announce=False)
    assert run.log.since(mark) == [
        "gateway.hold_llm_calls", "gateway.drain", "engines.pause_generation(in_place)", "engines.wait_idle",
        "engines.release_memory_occupation", "trainer.onload", "trainer.save_checkpoint",
        "engines.resume_memory_occupation(weights)", "weights.push(1 -> 2)", "weights.release_groups",
        "trainer.offload", "engines.resume_memory_occupation(kv_cache,cuda_graph)",
        "engines.continue_generation", "gateway.release_llm_calls"]
    resumed = make_run(*overrides)
    resumed_checkpoints = make_checkpoints(resumed, tmp_path)
    mark = len(resumed.log)
    assert resumed_checkpoints.resume()
    resumed.schedule.weights_loaded()  # what Pipeline.resume calls next
    steps = resumed.log.since(mark)
    assert steps.index("trainer.onload") < steps.index("trainer.load_checkpoint") < steps.index("weights.push(1 -> 2)")
    assert steps.count("weights.push(1 -> 2)") == 1 and resumed.trainer.offloaded
    assert (resumed.state.version, resumed.trainer.version) == (1, 1)
    _, train = resumed.step()
    assert train["train/policy_version"] == 2


def test_colocated_async_a_save_that_fails_keeps_the_devices_with_the_trainer_and_names_its_phase(tmp_path, capsys):
    """A rank lost while a checkpoint is written between steps: the failure is the save's (the run stops
    naming "checkpoint"), nothing is pushed from a trainer missing a rank (a push's own failure would hide the
    save's), and the survivor's checkpoint is written from live memory without another release/onload."""
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1, save_every=10)
    run.trainer.fail_in, run.trainer.survivors = "checkpoint", {1: 1}
    mark = len(run.log)
    with pytest.raises(TrainerFailure) as failure:
        checkpoints.save(announce=False)
    assert failure.value.phase == "checkpoint"
    steps = run.log.since(mark)
    assert steps[-2:] == ["trainer.onload", "trainer.save_checkpoint"] and run.schedule.devices_with_trainer
    run.trainer.fail_in = None
    mark = len(run.log)
    checkpoints.after_trainer_failure(failure.value)
    assert run.log.since(mark) == ["trainer.save_checkpoint"] and run.trainer.saved_from == [1]
    assert "trainer rank failure in checkpoint" in capsys.readouterr().out


def test_colocated_async_a_replacement_engine_gets_weights_from_the_onloaded_trainer():
    """Issue 41 E: an engine that joins between steps needs the current weights, which only the trainer's
    live memory holds: the devices go to the trainer and back, every engine (the new one too) pushed to."""
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")
    run.step()
    run.engines.down(1)
    mark = len(run.log)
    run.schedule.tick()
    steps = run.log.since(mark)
    assert steps.index("trainer.onload") < steps.index("weights.push(1 -> 2)") < steps.index("trainer.offload")
    assert steps[-2:] == ["fleet.mark_live(1)", "gateway.set_engines(http://e0 http://e1-new)"]
    assert run.trainer.offloaded and not run.schedule.devices_with_trainer
    run.step()


# -- the rerun and drop rules ------------------------------------------------------------------------


def test_async_drops_stale_groups_and_runs_their_tasks_again_first():
    run = make_run("pipeline.schedule=async", "pipeline.max_staleness=0", "pipeline.groups_in_flight=4")
    counts1: Counter = Counter()
    first, _ = run.step(counts1)
    assert counts1["dropped_stale_groups"] == 0 and [STARTED_ON[g.group_id] for g in first] == [0, 0]
    counts2: Counter = Counter()
    second, _ = run.step(counts2)
    # groups t2, t3 started at version 0 (before step 1's update): too old at version 1, so dropped,
    # counted, kept for the records and queued again in front as new groups; what trains is version 1's
    assert counts2["dropped_stale_groups"] == 2 and counts2["dropped_stale_samples"] == 4
    assert all(STARTED_ON[g.group_id] == 1 for g in second)
    stale = [g for g in run.state.set_aside]
    assert [g.task.task_id for g in stale] == ["t2", "t3"]
    assert all(e.info["discarded"] == "stale" for g in stale for e in g.episodes.values())
    reruns = [(task, front, reruns) for _, task, front, reruns in run.dispatcher.submitted if front]
    assert sorted(reruns) == [("t2", True, 1), ("t3", True, 1)]
    trained = [g.task.task_id for g in first + second]
    assert len(trained) == len(set(trained))  # no task trained twice


def test_a_group_short_of_scored_episodes_runs_again_until_the_bound_then_is_kept():
    def engine_fails_t0(group: Group, index: int) -> Episode:
        if group.task.task_id == "t0" and index == 1:
            return _episode(group, 0.0, ENGINE_ERROR)
        return scored_by_index(group, index)

    run = make_run("pipeline.schedule=sync", "rollout.prompts_per_step=1", "pipeline.max_group_reruns=2",
                   outcome=engine_fails_t0)
    counts: Counter = Counter()
    groups, _ = run.step(counts)
    # t0 ran three times (the first run, two reruns), the third is kept as it is; nothing else was drawn
    runs = [(task, reruns) for _, task, _, reruns in run.dispatcher.submitted]
    assert runs == [("t0", 0), ("t0", 1), ("t0", 2)]
    assert counts["rerun_short_groups"] == 2 and counts["short_groups_kept"] == 1
    assert [g.task.task_id for g in groups] == ["t0"] and groups[0].reruns == 2
    assert [e.info["discarded"] for g in run.state.set_aside for e in g.ordered()] == ["rerun"] * 4


def test_the_agents_own_failures_are_scored_never_run_again():
    def agent_crashes(group: Group, index: int) -> Episode:
        return _episode(group, 0.0, AGENT_CRASHED) if index == 0 else _episode(group, 1.0)

    run = make_run("pipeline.schedule=sync", outcome=agent_crashes)
    counts: Counter = Counter()
    groups, train = run.step(counts)
    assert counts["rerun_short_groups"] == 0 and not run.state.set_aside and len(groups) == 2
    assert train is not None  # the crash scored 0 beside a 1: the group varies and trains


def test_dynamic_sampling_replaces_equal_groups_with_new_ones():
    def t0_equal(group: Group, index: int) -> Episode:
        return _episode(group, 1.0) if group.task.task_id == "t0" else scored_by_index(group, index)

    run = make_run("pipeline.schedule=sync", "algorithm.dynamic_sampling=true", outcome=t0_equal)
    counts: Counter = Counter()
    groups, _ = run.step(counts)
    assert [g.task.task_id for g in groups] == ["t1", "t2"]  # t0 dropped, t2 drawn in its place
    assert [g.task.task_id for g in run.schedule.dropped] == ["t0"]
    assert counts["dynamic_dropped_groups"] == 1 and counts["dynamic_dropped_reward_1"] == 1


def test_sync_step_deadline_fails_the_unfinished_groups_and_goes_on():
    run = make_run("pipeline.schedule=sync", "rollout.step_deadline_s=0.05")
    run.dispatcher.stalled = True
    groups, train = run.step()
    assert len(groups) == 2 and train is None  # every episode failed: nothing trains, nothing is pushed
    assert all(e.failure == "step_deadline" for g in groups for e in g.ordered())
    assert "weights.push(1 -> 2)" not in run.log


def test_sync_after_a_step_deadline_updates_the_engines_with_nothing_generating():
    """Issue 41 F in sync: groups the deadline cut are failed, but their episodes' LLM calls may still run
    at the engines, and SGLang asserts after an update that flushes the cache with a request running; so
    that step's update goes the async way (calls held, abort, idle, update, continue)."""
    run = make_run("pipeline.schedule=sync", "rollout.step_deadline_s=0.05")
    run.dispatcher.stalled_tasks = {"t1"}
    mark = len(run.log)
    groups, train = run.step()
    assert [g.task.task_id for g in groups] == ["t0", "t1"] and train is not None
    assert run.log.since(mark) == [
        "trainer.train(2)", "gateway.hold_llm_calls", "engines.pause_generation(abort)", "engines.wait_idle",
        "weights.push(1 -> 2)", "engines.continue_generation", "gateway.release_llm_calls"]
    run.dispatcher.stalled_tasks = set()
    mark = len(run.log)
    run.step()
    assert run.log.since(mark) == ["trainer.train(4)", "weights.push(2 -> 2)"]  # nothing cut: as before


# -- engine membership ---------------------------------------------------------------------------------


def test_an_engine_that_dies_leaves_the_routers_and_returns_only_with_the_current_weights():
    run = make_run("pipeline.schedule=async")
    run.step()
    run.engines.down(1)
    mark = len(run.log)
    run.schedule.tick()
    # down: counted once, routed around; its replacement started in the same poll and joins with
    # version 1 the async way (calls held, engines paused), then is marked live, then routed to
    assert run.state.failures["engine_restarts"] == 1
    assert run.log.since(mark) == [
        "gateway.set_engines(http://e0)",
        "gateway.hold_llm_calls", "engines.pause_generation(abort)", "engines.wait_idle", "weights.push(1 -> 2)",
        "engines.continue_generation", "gateway.release_llm_calls",
        "fleet.mark_live(1)", "gateway.set_engines(http://e0 http://e1-new)"]
    mark = len(run.log)
    run.schedule.tick()
    assert run.log.since(mark) == [] and run.state.failures["engine_restarts"] == 1


def test_before_the_first_step_a_joining_engine_is_only_connected():
    run = make_run("pipeline.schedule=sync")
    run.engines.down(0)
    run.schedule.tick()
    assert run.log == ["gateway.set_engines(http://e1)", "weights.connect", "fleet.mark_live(0)",
                       "gateway.set_engines(http://e0-new http://e1)"]


def test_an_engine_that_dies_during_a_weight_update_is_left_out_and_the_others_are_sent_again():
    run = make_run("pipeline.schedule=sync")
    run.weights.fail_push = 1
    run.weights.during_push = lambda: run.engines.dies(1) if run.engines.slots[1].state == "live" else None
    _, train = run.step()
    assert train is not None and run.log[-2:] == ["weights.push(1 -> 2)", "weights.push(1 -> 1)"]
    assert run.state.failures["weight_sync_failures"] == 0
    mark = len(run.log)
    run.schedule.tick()  # the membership routes around it and lets its replacement in with version 1
    assert run.state.failures["engine_restarts"] == 1
    assert run.log.since(mark) == ["gateway.set_engines(http://e0)", "weights.push(1 -> 2)", "fleet.mark_live(1)",
                                   "gateway.set_engines(http://e0 http://e1-new)"]


@pytest.mark.parametrize("engine_dies", [False, True])
def test_a_failed_weight_update_is_counted_and_raised_once_no_engine_left_explains_it(engine_dies):
    """No engine died: the failure goes up at once. One died: the others get one more try, no more."""
    run = make_run("pipeline.schedule=sync")
    run.weights.fail_push = 2
    if engine_dies:
        run.weights.during_push = lambda: run.engines.dies(1) if run.engines.slots[1].state == "live" else None
    with pytest.raises(WeightSyncError, match="on purpose"):
        run.step()
    pushes = [line for line in run.log if line.startswith("weights.push")]
    assert pushes == (["weights.push(1 -> 2)", "weights.push(1 -> 1)"] if engine_dies else ["weights.push(1 -> 2)"])
    assert run.state.failures["weight_sync_failures"] == 1


def test_colocated_no_engine_joins_while_the_trainer_holds_the_devices():
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")

    def engine_dies_while_training() -> None:
        run.engines.down(0)
        deadline = time.monotonic() + 10
        while not run.engines.polls_refusing and time.monotonic() < deadline:  # the driver ticks meanwhile
            time.sleep(0.001)

    run.trainer.during_train = engine_dies_while_training
    mark = len(run.log)
    run.step()
    steps = run.log.since(mark)
    assert run.engines.polls_refusing >= 1  # its replacement waited for the devices
    assert "fleet.mark_live(0)" not in steps and run.engines.slots[0].state == "down"
    assert steps.index("gateway.set_engines(http://e1)") < steps.index("trainer.offload")
    mark = len(run.log)
    run.schedule.tick()  # devices back with the engines: the replacement starts, takes version 1, serves
    assert run.log.since(mark)[-2:] == ["fleet.mark_live(0)", "gateway.set_engines(http://e0-new http://e1)"]
    assert "weights.push(1 -> 2)" in run.log.since(mark)


# -- checkpoints and the way back after a trainer failure ----------------------------------------------


def make_checkpoints(run: Run, tmp_path: Path) -> RunCheckpoints:
    store = CheckpointStore(tmp_path / "ckpt", staging_root=tmp_path / "staging")
    return RunCheckpoints(store, run.trainer, run.parts.sampler, run.dispatcher, run.schedule, tmp_path)


def run_steps(run: Run, checkpoints: RunCheckpoints, steps: int, save_every: int = 1) -> list[str]:
    """actors/pipeline.py's loop, as far as checkpoints see it; returns the tasks of the groups trained."""
    trained: list[str] = []
    for _ in range(steps):
        run.state.step += 1
        checkpoints.start_step()
        groups = run.schedule.collect(Counter())
        checkpoints.untrained_taken = groups
        batch = build_batch([e for g in groups for e in g.ordered()], run.parts.cfg.algorithm)
        run.schedule.train(batch)
        checkpoints.step_trained()
        trained += [g.task.task_id for g in groups]
        if run.state.step % save_every == 0:
            checkpoints.save(announce=False)
    return trained


def resumed_queue(tmp_path: Path, *overrides: str) -> tuple[Run, list[str]]:
    run = make_run(*overrides)
    checkpoints = make_checkpoints(run, tmp_path)
    assert checkpoints.resume()
    return run, [g.task.task_id for g in run.dispatcher.queue]


@pytest.mark.parametrize("phase", ["rollout", "train"])
def test_a_failure_before_the_step_trained_checkpoints_the_previous_step_with_its_groups_untrained(
        phase, tmp_path, capsys):
    schedule = ("pipeline.schedule=async", "pipeline.groups_in_flight=4", "pipeline.max_staleness=1")
    run = make_run(*schedule)
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1, save_every=10)  # step 1 trained, never saved
    run.trainer.survivors = {1: 1}  # rank 0 died; rank 1 holds version 1
    run.state.step += 1
    checkpoints.start_step()
    taken = run.schedule.collect(Counter())
    checkpoints.untrained_taken = taken
    run.trainer.fail_in = "train"
    with pytest.raises(TrainerFailure) as failure:
        if phase == "train":
            run.schedule.train(build_batch([e for g in taken for e in g.ordered()], run.parts.cfg.algorithm))
        else:
            raise TrainerFailure("rollout", {0: "gone"}, {1: 1})
    run.trainer.fail_in = None
    checkpoints.after_trainer_failure(failure.value)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[rayrl] run stopped: trainer rank failure in")
    assert "Resume with: python driver.py" in line
    assert run.state.failures["trainer_rank_failures"] == 1 and run.trainer.saved_from == [1]
    assert (run.state.step, run.state.version) == (1, 1)
    untrained = [g.task.task_id for g in taken]
    untrained += [r["task"]["task_id"] for r in run.dispatcher.untrained_tasks()]
    resumed, queue = resumed_queue(tmp_path, *schedule)
    assert (resumed.state.step, resumed.state.version) == (1, 1) and queue == untrained
    assert queue[:2] == [g.task.task_id for g in taken]  # the step's own groups run first


def test_a_failure_after_the_trainer_step_checkpoints_this_step_trained(tmp_path, capsys):
    run = make_run("pipeline.schedule=colocated_async", "pipeline.max_staleness=1")
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1)
    run.trainer.survivors = {1: 2}
    run.trainer.fail_in = "offload"  # after the push, in the step's offload
    run.state.step += 1
    checkpoints.start_step()
    taken = run.schedule.collect(Counter())
    checkpoints.untrained_taken = taken
    with pytest.raises(TrainerFailure) as failure:
        run.schedule.train(build_batch([e for g in taken for e in g.ordered()], run.parts.cfg.algorithm))
    assert run.log[-3:] == ["weights.push(2 -> 2)", "weights.release_groups", "trainer.offload"]
    run.trainer.fail_in = None
    checkpoints.after_trainer_failure(failure.value)
    assert (run.state.step, run.state.version) == (2, 2) and checkpoints.untrained_taken == []
    resumed, queue = resumed_queue(tmp_path, "pipeline.schedule=colocated_async")
    assert (resumed.state.step, resumed.state.version) == (2, 2)
    assert not set(queue) & {g.task.task_id for g in taken}  # trained: never run again


def test_without_a_rank_holding_the_whole_state_the_newest_checkpoint_is_the_way_back(tmp_path, capsys):
    run = make_run("pipeline.schedule=sync")
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 2, save_every=1)
    run.trainer.full_state_on_every_rank = False  # Megatron shards the state over the ranks
    checkpoints.after_trainer_failure(TrainerFailure("train", {0: "gone"}, {1: 2}))
    out = capsys.readouterr().out
    assert f"Checkpoint: {checkpoints.store.location_of(2)}" in out and run.trainer.saved_from == [None, None]
    nobody = make_run("pipeline.schedule=sync")
    lost = TrainerFailure("train", {0: "gone"}, {})  # no rank survived
    make_checkpoints(nobody, tmp_path / "empty").after_trainer_failure(lost)
    assert "Checkpoint: none. Resume with: no checkpoint exists" in capsys.readouterr().out


def test_a_survivor_whose_save_fails_falls_back_to_the_newest_checkpoint(tmp_path, capsys):
    run = make_run("pipeline.schedule=sync")
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1)
    run.state.step += 1
    checkpoints.start_step()
    run.trainer.survivors = {1: 2}
    checkpoints.step_trained()  # step 2 trained, then the checkpoint failed
    run.trainer.fail_in = "checkpoint"
    checkpoints.after_trainer_failure(TrainerFailure("checkpoint", {0: "gone"}, {1: 2}))
    assert f"Checkpoint: {checkpoints.store.location_of(1)}" in capsys.readouterr().out


def test_async_resume_after_stale_drops_runs_the_untrained_groups_first_and_nothing_twice(tmp_path):
    """The fast twin of tests/pipeline/test_schedules_e2e.py::test_async_resume_runs_the_checkpoints_...:
    the dropped groups' tasks are queued again, the checkpoint holds every untrained group in order, and
    the resumed run takes only those, none of them trained before."""
    schedule = ("pipeline.schedule=async", "pipeline.max_staleness=0")
    run = make_run(*schedule, "pipeline.groups_in_flight=4")
    checkpoints = make_checkpoints(run, tmp_path)
    trained = run_steps(run, checkpoints, 2, save_every=2)
    assert len(trained) == len(set(trained)) == 4
    assert [g.task.task_id for g in run.state.set_aside]  # step 2 dropped stale groups (queued again)
    saved = checkpoints.store.read_state(2)["schedule"]
    untrained = [row["task"]["task_id"] for row in saved["untrained_groups"]]
    assert saved["schedule"] == "async" and len(untrained) >= 2 and not set(trained) & set(untrained)
    resumed, queue = resumed_queue(tmp_path, *schedule, f"pipeline.groups_in_flight={len(untrained)}")
    assert queue == untrained and (resumed.state.step, resumed.state.version) == (2, 2)
    groups, _ = resumed.step()
    step3 = {g.task.task_id for g in groups}
    assert step3 <= set(untrained) and not step3 & set(trained)


def test_a_failure_while_resuming_names_the_checkpoint_it_loaded_and_writes_nothing(tmp_path, capsys):
    """A rank lost while the checkpoint loads or its weights go to the engines (Pipeline.resume): nothing
    trained since it, so it is named as the way back and not written again."""
    run = make_run("pipeline.schedule=sync")
    run_steps(run, make_checkpoints(run, tmp_path), 2, save_every=2)
    resumed = make_run("pipeline.schedule=sync")
    checkpoints = make_checkpoints(resumed, tmp_path)
    assert checkpoints.resume()
    saves = list(resumed.trainer.saved_from)
    resumed.trainer.survivors = {1: 2}
    checkpoints.after_trainer_failure(TrainerFailure("weight push", {0: "gone"}, {1: 2}), save=False)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[rayrl] run stopped: trainer rank failure in weight push: rank 0: gone.")
    assert f"Checkpoint: {checkpoints.store.location_of(2)}. Resume with: python driver.py" in line
    assert resumed.trainer.saved_from == saves and checkpoints.store.latest() == 2
