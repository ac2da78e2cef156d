"""Staleness filtering and per-token policy versions, piece by piece (no Ray needed)."""

from __future__ import annotations

import numpy as np
import pytest

from rayrl.config import ConfigError, load_config
from rayrl.engines.client import GenerateOutput
from rayrl.engines.outputs import join_parts
from rayrl.machine import Machine
from rayrl.resolve import resolve
from rayrl.rl.failures import AGENT_CRASHED, ENGINE_ERROR
from rayrl.rl.groups import Group, split_stale
from rayrl.rl.staleness import token_staleness
from rayrl.trajectory import TrajectoryTree
from rayrl.types import Episode, Sample, Task, TurnRecord


def _sample(versions: list[int], mask: list[int]) -> Sample:
    n = len(versions)
    return Sample(tokens=np.arange(3 + n), prompt_length=3, loss_mask=mask, rollout_logprobs=np.zeros(n),
                  policy_versions=versions)


def _group(gid: str, *episodes: tuple[str, list[Sample]]) -> Group:
    g = Group(Task("q", task_id=gid), gid, size=len(episodes))
    for i, (status, samples) in enumerate(episodes):
        g.episodes[i] = Episode(session_id=f"s{i}", task_id=gid, group_id=gid, samples=samples, status=status)
    return g


def test_oldest_version_counts_trained_tokens_only():
    # version 0 only on a masked (tool output / bridge) token: not what the sample trains
    assert _sample([0, 3, 4], [0, 1, 1]).oldest_version() == 3
    assert _sample([1, 1], [0, 0]).oldest_version() is None


def test_split_stale_drops_whole_groups_beyond_max_staleness():
    fresh = _group("a", ("ok", [_sample([4, 4], [1, 1])]), ("ok", [_sample([5], [1])]))
    one_behind = _group("b", ("ok", [_sample([4, 5, 5], [1, 1, 1])]), ("ok", [_sample([5], [1])]))
    two_behind = _group("c", ("ok", [_sample([3, 5], [1, 1])]), ("ok", [_sample([5], [1])]))
    # an infrastructure failure's old samples are not trained, so they do not make its group stale (the
    # agent's own failures are scored and trained: rayrl/rl/failures.py)
    failed_old = _group("d", ("failed", [_sample([0], [1])]), ("ok", [_sample([5], [1])]))
    failed_old.episodes[0].failure = ENGINE_ERROR
    agent_old = _group("e", ("failed", [_sample([0], [1])]), ("ok", [_sample([5], [1])]))
    agent_old.episodes[0].failure = AGENT_CRASHED
    assert agent_old.staleness(5) == 5
    assert [g.staleness(5) for g in (fresh, one_behind, two_behind, failed_old)] == [1, 1, 2, 0]
    kept, dropped = split_stale([fresh, one_behind, two_behind, failed_old], version=5, max_staleness=1)
    assert [g.group_id for g in kept] == ["a", "b", "d"] and [g.group_id for g in dropped] == ["c"]
    kept, dropped = split_stale([fresh, one_behind, two_behind], version=5, max_staleness=0)
    assert kept == [] and len(dropped) == 3


def test_token_staleness_is_per_trained_token():
    samples = [_sample([0, 1, 2], [1, 0, 1]), _sample([2, 2], [1, 1])]
    assert token_staleness(samples, 2).tolist() == [2, 0, 0, 0]
    assert token_staleness([], 2).tolist() == []


def _out(ids, version, versions=None, finish="abort"):
    return GenerateOutput(output_ids=np.array(ids, np.int32), output_logprobs=-np.ones(len(ids), np.float32),
                          text="".join(f"<{i}>" for i in ids), finish_reason={"type": finish},
                          weight_version=version, versions=versions, prompt_tokens=5,
                          completion_tokens=len(ids), rid="r")


def test_join_parts_keeps_each_tokens_version():
    # part 1 ran on weights 3 (aborted by the pause), part 2 straddled an update from 4 to 5
    joined = join_parts([_out([7, 8], "3"), _out([9, 10, 11], "5", np.array([4, 4, 5], np.int32), "stop")])
    assert joined.output_ids.tolist() == [7, 8, 9, 10, 11]
    assert joined.versions.tolist() == [3, 3, 4, 4, 5]
    assert joined.text == "<7><8><9><10><11>" and joined.finish_reason == {"type": "stop"}
    assert joined.weight_version == "5" and joined.prompt_tokens == 5 and joined.completion_tokens == 5


def test_per_token_versions_stay_aligned_through_linearization():
    tree = TrajectoryTree()
    user = {"role": "user", "content": "q"}
    first = {"role": "assistant", "content": "a"}
    tool = {"role": "user", "content": "tool says 4"}
    tree.record_turn(TurnRecord(messages=[user], response_message=first, prompt_ids=[1, 2, 3],
                                response_ids=[10, 11], response_logprobs=[-1, -1], policy_version=0))
    # the second call was continued across a weight update: per-token versions
    tree.record_turn(TurnRecord(messages=[user, first, tool], response_message={"role": "assistant", "content": "b"},
                                prompt_ids=[1, 2, 3, 10, 11, 20, 21], response_ids=[30, 31, 32],
                                response_logprobs=[-1, -1, -1], policy_version=[0, 1, 1]))
    (sample,) = tree.samples(reward=1.0)
    assert sample.tokens.tolist() == [1, 2, 3, 10, 11, 20, 21, 30, 31, 32]
    assert sample.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    trained = sample.policy_versions[sample.loss_mask.astype(bool)].tolist()
    assert trained == [0, 0, 0, 1, 1] and sample.oldest_version() == 0


def test_tis_on_by_default_in_async_schedules_only():
    def tis_cap(*overrides: str) -> float:
        return resolve(load_config(None, list(overrides)), Machine(cores=2, cuda=False)).algorithm.tis_cap

    assert tis_cap("pipeline.schedule=sync") == 0.0
    assert tis_cap("pipeline.schedule=async") == 2.0
    assert tis_cap("pipeline.schedule=colocated_async") == 2.0
    assert tis_cap("pipeline.schedule=async", "algorithm.tis_cap=0") == 0.0  # explicit
    assert tis_cap("algorithm.tis_cap=1.5") == 1.5
    with pytest.raises(ConfigError, match="algorithm.tis_cap"):
        load_config(None, ["algorithm.tis_cap=-1"])
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        load_config(None, ["pipeline.schedule=sometimes"])
    with pytest.raises(ConfigError, match="pipeline.max_staleness"):
        load_config(None, ["pipeline.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.tool_delay_s"):
        load_config(None, ["rollout.tool_delay_s=[3,1]"])
