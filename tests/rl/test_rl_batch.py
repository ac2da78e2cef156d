"""The step's training batch (rayrl/rl/batch.py) from hand-built episodes: every sample of a scored
episode with its episode's GRPO advantage, infrastructure failures counted and left out."""

from __future__ import annotations

import numpy as np
import pytest

from rayrl.config import AlgorithmConfig
from rayrl.rl.batch import build_batch
from rayrl.types import Episode, Sample


def _sample(versions: list[int], mask: list[int] | None = None) -> Sample:
    n = len(versions)
    return Sample(tokens=np.arange(2 + n), prompt_length=2, loss_mask=mask or [1] * n,
                  rollout_logprobs=np.zeros(n), policy_versions=versions)


def _episode(group: str, reward: float, samples: list[Sample], status: str = "ok") -> Episode:
    return Episode(session_id=f"{group}-{reward}", task_id=group, group_id=group, samples=samples,
                   reward=reward, status=status, error=None if status == "ok" else "engine_error: x",
                   failure=None if status == "ok" else "engine_error")


def test_samples_carry_their_episode_advantage():
    episodes = [
        _episode("a", 1.0, [_sample([3, 3]), _sample([2])]),  # two branches: both get the advantage
        _episode("a", 0.0, [_sample([3])]),
        _episode("a", 0.0, [_sample([3])], status="failed"),  # an engine error: not in the group's baseline
        _episode("b", 0.5, [_sample([1, 1])]),
        _episode("b", 0.5, [_sample([1])]),
    ]
    batch = build_batch(episodes)
    assert batch.episodes_ok == 4 and batch.episodes_failed == 1
    assert len(batch.samples) == 5 and len(batch.advantages) == 5
    assert batch.samples[0] is episodes[0].samples[0] and batch.samples[2] is episodes[1].samples[0]
    # group a over the two successes: mean 0.5, std 0.5 -> +1, +1 (both branches), -1; group b: equal -> 0
    assert batch.advantages == pytest.approx([1.0, 1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert all(isinstance(a, float) for a in batch.advantages)
    assert batch.trains
    assert batch.staleness(4) == [1, 2, 1, 3, 3]


def test_without_std_and_nothing_to_learn():
    dr = AlgorithmConfig(advantage_estimator="dr_grpo")  # no std division
    batch = build_batch([_episode("a", 1.0, [_sample([0])]), _episode("a", 0.0, [_sample([0])])], dr)
    assert batch.advantages == pytest.approx([0.5, -0.5])
    flat = build_batch([_episode("a", 1.0, [_sample([0])]), _episode("a", 1.0, [_sample([0])])])
    assert not flat.trains and flat.advantages == [0.0, 0.0]
    empty = build_batch([_episode("a", 0.0, [], status="failed")])
    assert (empty.samples, empty.advantages, empty.episodes_ok, empty.episodes_failed) == ([], [], 0, 1)
    assert not empty.trains and empty.staleness(3) == []


def test_staleness_counts_trained_tokens_only():
    batch = build_batch([_episode("a", 1.0, [_sample([0, 5], mask=[0, 1]), _sample([0], mask=[0])])])
    assert batch.staleness(6) == [1]  # the untrained token (version 0) and the sample with none: ignored
