"""Every advantage estimator (rayrl/rl/advantages.py) and the overlong reward shaping against numbers
worked out by hand, and the module:function seam for an estimator of one's own."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayrl.config import AlgorithmConfig, ConfigError, load_config
from rayrl.rl.advantages import ESTIMATORS, EstimatorInput, estimate
from rayrl.rl.batch import build_batch
from rayrl.rl.shaping import overlong_penalty
from rayrl.types import Episode, Sample

# two groups: a = [1, 0, 0, 1] (mean 0.5, population std 0.5), b = [0.5, 0.5, 0.5, 1] (mean 0.625)
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 1.0]
GROUPS = ["a"] * 4 + ["b"] * 4
STD_B = math.sqrt((3 * 0.125**2 + 0.375**2) / 4)  # 0.2165


def _run(name: str, rewards=REWARDS, groups=GROUPS, tokens=None) -> np.ndarray:
    return estimate(name, EstimatorInput.of(rewards, groups, tokens))


def test_grpo_divides_by_the_group_std():
    adv = _run("grpo")
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert adv[4:] == pytest.approx([-0.125 / STD_B] * 3 + [0.375 / STD_B], abs=1e-4)
    assert np.all(_run("grpo", [1.0, 1.0, 1.0], ["g"] * 3) == 0)  # equal rewards: no signal


def test_dr_grpo_only_centres():
    assert _run("dr_grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.125, -0.125, -0.125, 0.375], abs=1e-6)


def test_rloo_leaves_each_episode_out_of_its_baseline():
    # a: a success's baseline is mean(0, 0, 1) = 1/3 -> 2/3; a failure's is mean(1, 0, 1) = 2/3 -> -2/3
    # b: a 0.5's baseline is mean(0.5, 0.5, 1) = 2/3 -> -1/6; the 1.0's is 0.5 -> 0.5
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 6, -1 / 6, -1 / 6, 0.5]
    assert _run("rloo") == pytest.approx(expected, abs=1e-6)
    assert _run("rloo", [1.0, 0.0, 3.0], ["x", "y", "y"]) == pytest.approx([0.0, -3.0, 3.0])  # a group of one: 0


def test_reinforce_pp_normalises_over_the_batch_by_tokens():
    # rewards 1, 0, 0, 1 with 1, 3, 1, 1 trained tokens: token mean 2/6 = 1/3,
    # token variance (4/9 + 3 * 1/9 + 1/9 + 4/9) / 6 = 2/9 -> std sqrt(2)/3
    adv = _run("reinforce_pp", [1.0, 0.0, 0.0, 1.0], ["a", "a", "b", "b"], [1, 3, 1, 1])
    std = math.sqrt(2) / 3
    assert adv == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, (2 / 3) / std], abs=1e-5)


def test_reinforce_pp_baseline_centres_by_group_then_normalises_by_batch():
    # centred: a -> +0.5, -0.5; b -> 0, 0; batch mean 0, std sqrt(0.5 / 4)
    adv = _run("reinforce_pp_baseline", [1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    s = math.sqrt(0.125)
    assert adv == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0], abs=1e-5)


def test_every_registered_estimator_is_tested_here():
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


def leave_best(x: EstimatorInput) -> np.ndarray:
    """An estimator of one's own (module:function): +1 for each group's best episode, 0 elsewhere."""
    out = np.zeros(len(x.rewards), np.float32)
    for idx in x.groups():
        out[idx[np.argmax(x.rewards[idx])]] = 1.0
    return out


def bad_shape(x: EstimatorInput) -> np.ndarray:
    return np.zeros(len(x.rewards) + 1)


def test_an_estimator_of_ones_own_by_module_path():
    cfg = load_config(None, ["algorithm.advantage_estimator=tests.test_advantages:leave_best"])
    assert _run(cfg.algorithm.advantage_estimator).tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="returned shape"):
        _run("tests.test_advantages:bad_shape")
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: cannot load"):
        load_config(None, ["algorithm.advantage_estimator=tests.test_advantages:missing"])
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: unknown 'grp0'; registered: dr_grpo"):
        load_config(None, ["algorithm.advantage_estimator=grp0"])
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: gae needs a critic"):
        load_config(None, ["algorithm.advantage_estimator=gae"])


def test_overlong_penalty_by_hand():
    # L_max 100, buffer 20: free up to 80, then linear to -1 at 100, -1 beyond
    assert [overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 101)] == pytest.approx([0, 0, -0.5, -1.0, -1.0])
    assert overlong_penalty(10_000, 0, 0) == 0.0  # off
    assert overlong_penalty(95, 100, 20, scale=0.5) == pytest.approx(-0.375)


def test_overlong_shaping_changes_the_advantages_not_the_recorded_rewards():
    def episode(reward: float, generated: int) -> Episode:
        s = Sample(tokens=np.arange(3 + generated), prompt_length=3, loss_mask=np.ones(generated),
                   rollout_logprobs=np.zeros(generated), policy_versions=np.zeros(generated))
        return Episode(f"s{generated}", "t", "g", [s], reward=reward)

    episodes = [episode(1.0, 10), episode(1.0, 30)]  # both right; the second ran past the limit
    plain = build_batch(episodes)
    assert plain.advantages == [0.0, 0.0] and not plain.trains
    shaped = build_batch(episodes, AlgorithmConfig(overlong_max_tokens=20, overlong_buffer_tokens=5))
    assert shaped.advantages == pytest.approx([1.0, -1.0], abs=1e-5)  # GRPO over 1.0 and 1.0 - 1.0
    assert shaped.metrics == {"shaping/overlong_episodes": 1.0, "shaping/overlong_penalty_mean": -0.5}
    assert [e.reward for e in episodes] == [1.0, 1.0]
