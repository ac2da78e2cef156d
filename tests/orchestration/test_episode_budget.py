"""``pipeline.episode_budget`` is exact in every schedule: a group starts only if the budget has room for all its
episodes, groups queued ahead (async prefetch) are counted when queued, and the step that runs out stops
drawing and trains on what it kept. Driven with tests/orchestration/schedule_fakes.py (no Ray): each fake
group completes at the next poll, so the episodes started are exactly the groups submitted x group size.

Before this rule the budget was checked after each step, so a dynamic-sampling step went on drawing past it
(examples/files seed 1: 184 episodes for a budget of 160, docs/results/algorithms.md).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

import pytest

from rayrl.metrics import summary_line
from rayrl.rl.batch import build_batch
from rayrl.rl.failures import ENGINE_ERROR
from rayrl.rl.groups import Group
from rayrl.rl.step_metrics import EngineWork, step_metrics
from rayrl.types import Episode
from tests.orchestration.schedule_fakes import Run, _episode, make_run, scored_by_index

Step = tuple[list[Group], Counter, Optional[dict[str, Any]]]


def run_until_spent(run: Run, max_steps: int = 10) -> list[Step]:
    """What actors/pipeline.py's loop does: steps until the schedule says the budget is spent."""
    steps: list[Step] = []
    while not run.schedule.budget_spent:
        assert len(steps) < max_steps, "the budget never ran out"
        counts: Counter = Counter()
        groups, train = run.step(counts)
        steps.append((groups, counts, train))
    return steps


def equal_for(*task_ids: str):
    """An outcome: the groups of ``task_ids`` score 1 on every episode (dynamic sampling drops them), the
    others 0, 1, 0, ..."""
    def outcome(group: Group, index: int) -> Episode:
        return _episode(group, 1.0) if group.task.task_id in task_ids else scored_by_index(group, index)
    return outcome


def started(run: Run) -> list[str]:
    """The tasks of every group submitted to the dispatcher, in order."""
    return [task for _, task, _, _ in run.dispatcher.submitted]


def test_a_budget_not_a_multiple_of_the_group_size_starts_only_whole_groups():
    # groups of 3, 2 per step, budget 16: five groups (15 episodes) fit, a sixth (18) would not
    run = make_run("pipeline.schedule=sync", "rollout.group_size=3", "pipeline.episode_budget=16")
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3", "t4"] and run.state.episodes == 15
    assert [len(groups) for groups, _, _ in steps] == [2, 2, 1]  # the last step trains on the one group left
    assert [counts["budget_stopped_draws"] for _, counts, _ in steps] == [0, 0, 1]
    assert all(train is not None for _, _, train in steps)


def test_an_exact_multiple_ends_after_the_last_full_step_without_a_stop():
    run = make_run("pipeline.schedule=sync", "pipeline.episode_budget=8")
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3"] and run.state.episodes == 8
    assert [len(groups) for groups, _, _ in steps] == [2, 2]
    assert not any("budget_stopped_draws" in counts for _, counts, _ in steps)


def test_dynamic_sampling_stops_drawing_where_the_budget_runs_out_and_trains_on_what_it_kept():
    # budget 10, groups of 2: five groups. t0, t1 equal (dropped), t2 kept, t3 dropped, t4 dropped: the budget
    # is spent with one of the two groups kept, so the step trains on t2 alone and t5 never starts
    run = make_run("pipeline.schedule=sync", "algorithm.dynamic_sampling=true", "pipeline.episode_budget=10",
                   outcome=equal_for("t0", "t1", "t3", "t4"))
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3", "t4"] and run.state.episodes == 10
    assert len(steps) == 1
    groups, counts, train = steps[0]
    assert [g.task.task_id for g in groups] == ["t2"] and train is not None
    assert run.log.count("trainer.train(2)") == 1  # one group of two episodes trained
    assert [g.task.task_id for g in run.schedule.dropped] == ["t0", "t1", "t3", "t4"]
    assert counts == {"dynamic_groups_drawn": 5, "dynamic_dropped_groups": 4, "dynamic_dropped_reward_1": 4,
                      "budget_stopped_draws": 1, "short_groups_kept": 0}


def test_a_dynamic_sampling_step_that_kept_nothing_does_not_train_and_says_so():
    # budget 6: t0, t1 dropped, then room for one more group (t2), dropped too; the step kept no group
    run = make_run("pipeline.schedule=sync", "algorithm.dynamic_sampling=true", "pipeline.episode_budget=6",
                   outcome=equal_for("t0", "t1", "t2"))
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2"] and run.state.episodes == 6
    groups, counts, train = steps[0]
    assert len(steps) == 1 and groups == [] and train is None
    assert not any(entry.startswith("trainer.train") for entry in run.log) and "weights.push(1 -> 2)" not in run.log
    assert counts["budget_stopped_draws"] == 2 and counts["dynamic_dropped_groups"] == 3
    drawn = [e for g in run.schedule.dropped for e in g.ordered()]
    metrics = step_metrics(drawn, build_batch([], run.parts.cfg.algorithm), version=0, policy_version=0, train=None,
                           pipeline_counts=counts, groups_in_flight=0, failures={},
                           engines=EngineWork(0, 0, {}, 1.0, 1), extra={}, rollout_s=0.0, step_s=1.0,
                           run_episodes=6, run_s=1.0)
    line = summary_line(1, 10, metrics)
    assert "samples 0" in line and "equal groups dropped 3" in line and "groups the budget left undrawn 2" in line


@pytest.mark.parametrize("schedule", ["async", "colocated_async"])
def test_groups_queued_ahead_are_counted_when_queued_so_prefetch_stays_inside_the_budget(schedule):
    # 4 groups kept in flight, 2 per step, budget 10 (five groups of 2): the first collect queues four (8
    # episodes), then only one more fits; steps take 2, 2, then the one left, and nothing else ever starts
    run = make_run(f"pipeline.schedule={schedule}", "pipeline.groups_in_flight=4", "pipeline.max_staleness=4",
                   "pipeline.episode_budget=10")
    counts: Counter = Counter()
    taken, _ = run.step(counts)
    # the groups queued ahead are paid for already: 4 or 5 queued (8 or 10 episodes), 2 taken (4 episodes)
    assert len(taken) == 2 and run.state.episodes == 2 * len(started(run)) in (8, 10)
    assert run.dispatcher.groups_in_flight == len(started(run)) - 2
    steps = [([], counts, None)] + run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3", "t4"] and run.state.episodes == 10
    assert run.log.count("trainer.train(4)") == 2 and run.log.count("trainer.train(2)") == 1
    assert [c["budget_stopped_draws"] for _, c, _ in steps] == [0, 0, 1]


def test_a_stale_group_past_the_budget_is_dropped_without_a_rerun():
    # budget 8: t0..t3 queued at version 0; step 1 trains t0, t1; at version 1 t2, t3 are too old
    # (max_staleness 0), and the budget has no room to run them again: the step keeps nothing and the run ends
    run = make_run("pipeline.schedule=async", "pipeline.groups_in_flight=4", "pipeline.max_staleness=0",
                   "pipeline.episode_budget=8")
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3"] and run.state.episodes == 8
    (first, _, trained), (second, counts, untrained) = steps
    assert len(first) == 2 and trained is not None and second == [] and untrained is None
    assert counts["dropped_stale_groups"] == 2 and counts["budget_skipped_reruns"] == 2
    assert counts["budget_stopped_draws"] == 2
    assert [g.task.task_id for g in run.state.set_aside] == ["t2", "t3"]  # recorded as stale, not lost silently


def test_a_group_both_short_and_stale_past_the_budget_counts_one_skipped_rerun():
    # as above, and t2 also lost an episode to the engine: the budget refuses its rerun as a short group, then
    # again as a stale one; one group whose rerun was refused is one count, not two
    def engine_fails_t2(group: Group, index: int) -> Episode:
        if group.task.task_id == "t2" and index == 1:
            return _episode(group, 0.0, ENGINE_ERROR)
        return scored_by_index(group, index)

    run = make_run("pipeline.schedule=async", "pipeline.groups_in_flight=4", "pipeline.max_staleness=0",
                   "pipeline.episode_budget=8", outcome=engine_fails_t2)
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1", "t2", "t3"] and run.state.episodes == 8
    _, counts, _ = steps[1]
    assert counts["short_groups_kept"] == 1 and counts["dropped_stale_groups"] == 2
    assert counts["budget_skipped_reruns"] == 2  # t2 once (short and stale), t3 once (stale)
    assert [g.task.task_id for g in run.state.set_aside] == ["t2", "t3"]


def test_a_short_group_past_the_budget_is_kept_as_it_is():
    def engine_fails_t0(group: Group, index: int) -> Episode:
        if group.task.task_id == "t0" and index == 1:
            return _episode(group, 0.0, ENGINE_ERROR)
        return scored_by_index(group, index)

    run = make_run("pipeline.schedule=sync", "pipeline.episode_budget=4", outcome=engine_fails_t0)
    steps = run_until_spent(run)
    assert started(run) == ["t0", "t1"] and run.state.episodes == 4
    groups, counts, _ = steps[0]
    assert [g.task.task_id for g in groups] == ["t0", "t1"]
    assert counts["budget_skipped_reruns"] == 1 and counts["short_groups_kept"] == 1
    assert counts["rerun_short_groups"] == 0


def test_without_a_budget_dynamic_sampling_draws_as_before():
    run = make_run("pipeline.schedule=sync", "algorithm.dynamic_sampling=true", outcome=equal_for("t0", "t1", "t3"))
    counts: Counter = Counter()
    groups, _ = run.step(counts)
    assert [g.task.task_id for g in groups] == ["t2", "t4"] and started(run) == ["t0", "t1", "t2", "t3", "t4"]
    assert "budget_stopped_draws" not in counts and not run.schedule.budget_spent


@pytest.mark.parametrize("old_format", [False, True])
def test_a_resumed_run_keeps_to_the_budget(old_format, tmp_path):
    # async, 4 groups of 2 in flight, 2 per step, budget 12 (six groups): step 1 queues four groups (8 episodes
    # counted) and trains two; a checkpoint then, resumed into a fresh run, restores the two untrained groups
    # without counting them again and starts two more: six groups in all. A checkpoint written before the count
    # meant "queued" (no ``episodes_counted``, episodes = those taken: 4) counts its restored groups on resume,
    # so the resumed run can end early but never runs over.
    from tests.orchestration.test_schedule_phases import make_checkpoints, run_steps

    schedule = ("pipeline.schedule=async", "pipeline.groups_in_flight=4", "pipeline.max_staleness=4",
                "pipeline.episode_budget=12")
    run = make_run(*schedule)
    checkpoints = make_checkpoints(run, tmp_path)
    run_steps(run, checkpoints, 1)
    assert run.state.episodes == 8 and len(started(run)) == 4
    if old_format:
        marker = next((tmp_path / "ckpt").glob("*/pipeline.json"))
        state = json.loads(marker.read_text())
        del state["schedule"]["episodes_counted"]
        state["schedule"]["episodes"] = 4  # the two groups step 1 took
        marker.write_text(json.dumps(state))
    resumed = make_run(*schedule)
    assert make_checkpoints(resumed, tmp_path).resume()
    assert resumed.state.episodes == 8  # restored groups counted once, in either format
    run_until_spent(resumed)
    # the two restored groups run again (fresh episodes), then two new ones: six groups, 12 episodes in all
    assert started(resumed) == ["t2", "t3", "t4", "t5"] and resumed.state.episodes == 12
