"""Every advantage estimator (rayrl/rl/advantages.py) and the overlong reward shaping against numbers
worked out by hand, and the module:function seam for an estimator of one's own."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from rayrl.config import AlgorithmConfig, ConfigError, load_config
from rayrl.resolve import load_checked
from rayrl.rl.advantages import (
    ESTIMATORS,
    EstimatorInput,
    EstimatorOptions,
    advantage_estimator,
    estimate,
    estimator_traits,
)
from rayrl.rl.batch import build_batch
from rayrl.rl.shaping import overlong_penalty
from rayrl.types import Episode, Sample

GROUP_ESTIMATORS = sorted(name for name, row in ESTIMATORS.items() if row.grouped)  # need >= 2 episodes per task

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


@estimator_traits(grouped=True, aggregation="seq_mean_token_sum")
def grouped_best(x: EstimatorInput) -> np.ndarray:
    """An estimator of one's own that declares its traits: it needs groups, and sums each sequence's tokens."""
    return leave_best(x)


def test_an_estimator_of_ones_own_declares_its_traits():
    """Undeclared: ungrouped, loss_agg left to the loss (as before). Declared: the check and resolve read its row."""
    from rayrl.machine import Machine
    from rayrl.resolve import resolve

    mine = "algorithm.advantage_estimator=tests.rl.test_advantages:"
    plain = advantage_estimator("tests.rl.test_advantages:leave_best")
    assert not plain.grouped and plain.aggregation is None
    load_checked(None, [mine + "leave_best", "rollout.group_size=1"])  # no group needed
    with pytest.raises(ConfigError, match="^rollout.group_size: tests.rl.test_advantages:grouped_best measures each "
                                          "episode against its group"):
        load_checked(None, [mine + "grouped_best", "rollout.group_size=1"])
    algo = resolve(load_checked(None, [mine + "grouped_best"]), Machine(cores=2, cuda=False)).algorithm
    assert algo.loss_agg == "seq_mean_token_sum"
    gspo = resolve(load_checked(None, [mine + "grouped_best", "algorithm.policy_loss=gspo"]),
                   Machine(cores=2, cuda=False)).algorithm
    assert gspo.loss_agg == "seq_mean_token_mean"  # the loss's own aggregation wins, as over dr_grpo's


def bad_shape(x: EstimatorInput) -> np.ndarray:
    return np.zeros(len(x.rewards) + 1)


def test_an_estimator_of_ones_own_by_module_path():
    cfg = load_config(None, ["algorithm.advantage_estimator=tests.rl.test_advantages:leave_best"])
    assert _run(cfg.algorithm.advantage_estimator).tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="returned shape"):
        _run("tests.rl.test_advantages:bad_shape")
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: cannot load"):
        load_checked(None, ["algorithm.advantage_estimator=tests.rl.test_advantages:missing"])
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: unknown 'grp0'; registered: dr_grpo"):
        load_checked(None, ["algorithm.advantage_estimator=grp0"])
    with pytest.raises(ConfigError, match="^algorithm.advantage_estimator: gae needs a critic"):
        load_checked(None, ["algorithm.advantage_estimator=gae"])


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


# -- exact zeros and the conventions (docs/algorithms.md, "Conventions") ---------------------------------------------

NOT_BINARY = [0.1, 0.1, 0.1, 0.7, 0.7, 0.7]  # equal groups whose float means are not exactly 0.1 / 0.7


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_equal_rewards_give_exactly_zero_in_every_estimator(name):
    groups = ["a"] * 3 + ["b"] * 3
    if name == "reinforce_pp":  # no group baseline: the whole batch must be equal
        rewards, groups = [0.1] * 6, ["a"] * 3 + ["b"] * 3
    else:
        rewards = NOT_BINARY
    assert np.float64(sum([0.1] * 3)) / 3 != 0.1  # the case the exact zero is for
    adv = _run(name, rewards, groups, [3, 1, 2, 5, 1, 1])
    assert adv.tolist() == [0.0] * 6
    # within the tolerance dynamic sampling uses is equal too; just outside it is not
    near = _run(name, [0.3, 0.3 + 5e-10, 0.3], ["a"] * 3)
    assert near.tolist() == [0.0] * 3
    apart = _run(name, [0.3, 0.3 + 1e-6, 0.3], ["a"] * 3)
    assert np.count_nonzero(apart) >= 1


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_an_equal_group_beside_a_varied_one_stays_exactly_zero(name):
    adv = _run(name, [0.1, 0.1, 0.1, 0.0, 1.0, 1.0], ["a"] * 3 + ["b"] * 3, [7, 2, 4, 3, 1, 2])
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert np.all(adv[3:] != 0)


def test_an_episode_at_its_group_baseline_gets_exactly_zero():
    # 0.2 - mean(0.1, 0.2, 0.3) is 2.8e-17 in floats; RLOO: 0.2 - mean(0.1, 0.3) likewise
    for name in ("grpo", "dr_grpo", "rloo"):
        assert _run(name, [0.1, 0.2, 0.3], ["g"] * 3)[1] == 0.0


def test_equal_reward_and_the_estimators_share_one_tolerance():
    from rayrl.rl import groups
    from rayrl.rl.advantages import REWARD_TOLERANCE

    assert inspect.signature(groups.equal_reward).parameters["tolerance"].default is REWARD_TOLERANCE


def test_grpo_std_population_or_sample():
    # a = [1, 0, 0, 1]: population std 0.5, sample std sqrt(1/3)
    pop = _run("grpo", [1.0, 0.0, 0.0, 1.0], ["a"] * 4)
    sample = estimate("grpo", EstimatorInput.of([1.0, 0.0, 0.0, 1.0], ["a"] * 4,
                                                options=EstimatorOptions(grpo_std="sample")))
    p = 0.5 / (0.5 + 1e-6)
    assert pop == pytest.approx([p, -p, -p, p], abs=1e-7)
    s = math.sqrt(1 / 3)
    assert sample == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)], abs=1e-7)
    assert AlgorithmConfig().grpo_std == "population"
    batch = build_batch(_episodes([1.0, 0.0, 0.0, 1.0]), AlgorithmConfig(grpo_std="sample"))
    assert batch.advantages == pytest.approx(sample.tolist(), abs=1e-7)
    with pytest.raises(ConfigError, match="grpo_std"):
        load_config(None, ["algorithm.grpo_std=bessel"])


def test_grpo_epsilon_is_added_to_the_std_outside_the_sqrt():
    # rewards 0 and 2e-6: population std 1e-6 -> 1e-6 / (1e-6 + 1e-6) = 0.5 (inside the sqrt it would be ~1e-3)
    assert _run("grpo", [0.0, 2e-6], ["g", "g"]) == pytest.approx([-0.5, 0.5], abs=1e-6)
    # REINFORCE++: token-weighted std 1e-6 likewise
    assert _run("reinforce_pp", [0.0, 2e-6], ["g", "h"]) == pytest.approx([-0.5, 0.5], abs=1e-6)


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_singleton_groups_zero_or_their_reward(name):
    rewards, groups = [0.8, 1.0, 0.0], ["one", "two", "two"]
    assert _run(name, rewards, groups)[0] == 0.0
    raw = estimate(name, EstimatorInput.of(rewards, groups, options=EstimatorOptions(singleton_groups="reward")))
    if name == "reinforce_pp_baseline":  # the raw reward enters the batch whitening like any other value
        values = np.array([0.8, 0.5, -0.5])
        mean = values.mean()
        std = math.sqrt(((values - mean) ** 2).mean())
        assert raw[0] == pytest.approx((0.8 - mean) / (std + 1e-6), abs=1e-6)
    else:  # verl: baseline 0 (and std 1 for GRPO)
        assert raw[0] == pytest.approx(0.8 / (1 + 1e-6) if name == "grpo" else 0.8, abs=1e-7)
    assert AlgorithmConfig().singleton_groups == "zero"


def test_reinforce_pp_baseline_whitening_is_token_weighted_and_re_centred():
    # centred by group: a -> +0.5, -0.5 ; b -> +0.25, -0.25 ; tokens 3, 1, 1, 1
    # token mean (1.5 - 0.5 + 0.25 - 0.25) / 6 = 1/6; token variance of (v - 1/6) weighted by tokens
    adv = _run("reinforce_pp_baseline", [1.0, 0.0, 0.5, 0.0], ["a", "a", "b", "b"], [3, 1, 1, 1])
    v = np.array([0.5, -0.5, 0.25, -0.25])
    w = np.array([3, 1, 1, 1], float)
    mean = (w * v).sum() / w.sum()
    std = math.sqrt((w * (v - mean) ** 2).sum() / w.sum())
    assert mean == pytest.approx(1 / 6)
    assert adv == pytest.approx((v - mean) / (std + 1e-6), abs=1e-6)


def _episodes(rewards: list[float]) -> list[Episode]:
    def one(i: int, r: float) -> Episode:
        s = Sample(tokens=np.arange(5), prompt_length=3, loss_mask=np.ones(2), rollout_logprobs=np.zeros(2),
                   policy_versions=np.zeros(2))
        return Episode(f"e{i}", "t", "g", [s], reward=r)
    return [one(i, r) for i, r in enumerate(rewards)]


def test_an_equal_group_of_fractional_rewards_trains_nothing():
    batch = build_batch(_episodes([0.1, 0.1, 0.1]))
    assert batch.advantages == [0.0, 0.0, 0.0] and not batch.trains
