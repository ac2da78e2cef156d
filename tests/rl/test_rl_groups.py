"""Groups that infrastructure left short run again, the agent's own failures are scored; failures are classified
(rayrl/rl, no Ray)."""

from __future__ import annotations

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.rl.batch import build_batch
from rayrl.rl.failures import (
    AGENT_CRASHED,
    ENGINE_ERROR,
    NO_TURNS,
    REWARD_FAILED,
    SANDBOX_FAILED,
    fail,
    failure_kind,
    is_infra,
    is_scored,
)
from rayrl.rl.groups import Group, split_short
from rayrl.types import Episode, Sample, Task


def _episode(gid: str, reward: float, failure: str | None = None) -> Episode:
    sample = Sample(tokens=[1, 2, 3, 4], prompt_length=2, loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                    policy_versions=[0, 0])
    episode = Episode(session_id="s", task_id=gid, group_id=gid, samples=[sample], reward=reward)
    return fail(episode, failure, "on purpose") if failure else episode


def _group(gid: str, *episodes: Episode, reruns: int = 0) -> Group:
    group = Group(Task("q", task_id=gid), gid, size=len(episodes), reruns=reruns)
    group.episodes = dict(enumerate(episodes))
    return group


def test_a_group_with_too_few_successes_runs_again_then_is_kept():
    full = _group("a", _episode("a", 1.0), _episode("a", 0.0), _episode("a", 0.0, ENGINE_ERROR))
    short = _group("b", _episode("b", 1.0), _episode("b", 0.0, ENGINE_ERROR), _episode("b", 0.0, SANDBOX_FAILED))
    worn = _group("c", _episode("c", 1.0), _episode("c", 0.0, ENGINE_ERROR), _episode("c", 0.0, ENGINE_ERROR), reruns=2)
    keep, rerun = split_short([full, short, worn], min_episodes=2, max_reruns=2)
    assert [g.group_id for g in keep] == ["a", "c"] and [g.group_id for g in rerun] == ["b"]
    assert (full.scored, short.scored, worn.scored) == (2, 1, 1)


def test_wrong_answers_count_as_successes():
    wrong = _group("w", _episode("w", 0.0), _episode("w", 0.0))  # both scored 0: a valid (if flat) group
    assert split_short([wrong], min_episodes=2, max_reruns=2) == ([wrong], [])


def test_infrastructure_failures_stay_out_of_the_baseline_the_agents_own_are_scored():
    crashed = _episode("g", 0.0, AGENT_CRASHED)  # the reward function gave the crashed agent 0.0
    episodes = [_episode("g", 1.0), _episode("g", 1.0), _episode("g", 0.0, ENGINE_ERROR), crashed]
    batch = build_batch(episodes)
    assert batch.episodes_ok == 2 and batch.episodes_failed == 2 and batch.episodes_excluded == 1
    assert len(batch.samples) == 3  # the two successes and the crash; the engine error trains nothing
    # rewards [1, 1, 0]: mean 2/3, std 0.471
    assert batch.advantages == pytest.approx([0.7071, 0.7071, -1.4142], abs=1e-3)


def test_a_task_whose_agent_always_fails_is_scored_not_run_again():
    crashes = _group("k", *[_episode("k", 0.0, AGENT_CRASHED) for _ in range(4)])
    reward_bug = _group("r", *[_episode("r", 0.0, REWARD_FAILED) for _ in range(4)])
    silent = _group("n", _episode("n", 0.0, NO_TURNS), _episode("n", 0.0, NO_TURNS))
    keep, rerun = split_short([crashes, reward_bug, silent], min_episodes=2, max_reruns=2)
    assert rerun == [] and [g.group_id for g in keep] == ["k", "r", "n"]
    assert not any(e.ok for e in crashes.ordered()) and crashes.scored == 4 and not crashes.infra_causes()
    batch = build_batch(crashes.ordered())
    assert len(batch.samples) == 4 and not batch.trains  # equal rewards: no gradient, and no rerun either


def test_a_short_group_names_its_infrastructure_causes():
    short = _group("b", _episode("b", 1.0), _episode("b", 0.0, ENGINE_ERROR), _episode("b", 0.0, ENGINE_ERROR),
                   _episode("b", 0.0, SANDBOX_FAILED))
    assert dict(short.infra_causes()) == {"engine_error": 2, "sandbox_failed": 1} and short.scored == 1


def test_failure_kinds_and_classes():
    assert failure_kind(_episode("g", 0.0, ENGINE_ERROR)) == "engine_error" and is_infra(_episode("g", 0, ENGINE_ERROR))
    crashed = _episode("g", 0.0, AGENT_CRASHED)
    assert failure_kind(crashed) == "agent_crashed" and not is_infra(crashed)
    assert crashed.error == "agent_crashed: on purpose"
    assert not is_infra(_episode("g", 0.0))  # an ok episode is no failure at all
    legacy = Episode(session_id="", task_id="t", group_id="g", status="failed", error="custom thing: detail")
    assert failure_kind(legacy) == "custom thing" and not is_infra(legacy)
    assert is_scored(crashed) and is_scored(_episode("g", 0.0, REWARD_FAILED))
    assert not is_scored(_episode("g", 0, ENGINE_ERROR))


def test_min_group_episodes_is_capped_at_the_group_size():
    pair = _group("p", _episode("p", 1.0), _episode("p", 0.0, ENGINE_ERROR))  # size 2: both must succeed
    single = _group("s", _episode("s", 1.0))  # size 1 (a non-GRPO loss): its one success is enough
    keep, rerun = split_short([pair, single], min_episodes=4, max_reruns=2)
    assert [g.group_id for g in keep] == ["s"] and [g.group_id for g in rerun] == ["p"]


def test_min_group_episodes_is_checked_at_load():
    # no group baseline; the default 2 is capped, valid
    cfg = load_config(None, ["rollout.group_size=1", "algorithm.advantage_estimator=reinforce_pp"])
    assert cfg.rollout.min_group_episodes == 2
    with pytest.raises(ConfigError, match="rollout.min_group_episodes"):
        load_config(None, ["rollout.min_group_episodes=0"])


def test_dynamic_sampling_drops_equal_groups_until_its_bound():
    from collections import Counter

    from rayrl.orchestration.schedules import Schedule
    from rayrl.resolve import resolve
    from rayrl.rl.groups import equal_reward

    flat0 = _group("z", _episode("z", 0.0), _episode("z", 0.0), _episode("z", 1.0, ENGINE_ERROR))  # failure ignored
    flat1 = _group("o", _episode("o", 1.0), _episode("o", 1.0))
    mixed = _group("m", _episode("m", 1.0), _episode("m", 0.0))
    assert (equal_reward(flat0), equal_reward(flat1), equal_reward(mixed)) == (0.0, 1.0, None)
    assert equal_reward(_group("f", _episode("f", 1.0, ENGINE_ERROR))) is None  # nothing succeeded: not "equal"

    schedule = Schedule.__new__(Schedule)  # only the filter: no actors
    schedule.cfg = resolve(load_config(None, ["algorithm.dynamic_sampling=true", "rollout.prompts_per_step=1",
                                              "algorithm.dynamic_sampling_max_groups=4"]))
    schedule.dropped = []
    counts: Counter = Counter()
    assert schedule.keep_varied([flat0, mixed, flat1], counts) == [mixed]
    assert schedule.dropped == [flat0, flat1]
    assert counts == {"dynamic_groups_drawn": 3, "dynamic_dropped_groups": 2, "dynamic_dropped_reward_0": 1,
                      "dynamic_dropped_reward_1": 1}
    # the fourth group drawn is the last that may be dropped; past the bound an equal group is kept
    assert schedule.keep_varied([flat1, flat0], counts) == [flat0]
    assert counts["dynamic_groups_drawn"] == 5 and counts["dynamic_kept_equal"] == 1
    schedule.cfg = resolve(load_config(None, []))  # off (the default): every group is kept
    assert schedule.keep_varied([flat0, flat1], Counter()) == [flat0, flat1]
