"""Pins for the formulas and defaults a hand-computed value alone did not catch (issue 42, part 3).

Each test here was written against a planted error that the other formula tests let through (the list is in
scripts/plants_formulas.py; `scripts/mutation_check.py --set formulas` plants them and more, one at a time,
and requires these tests to fail for each): dual-clip reaching positive advantages, a missing log-ratio
clamp, a gradient through the KL penalty in the reward, the KL loss weighted by TIS, every default of the
algorithm section (loss aggregation auto, the clip bands, the Dr.GRPO constant, TIS by schedule), and the
learning-rate schedule's total with several epochs per rollout. REINFORCE++-baseline's whitening, GRPO's
epsilon and the exact zeros are pinned in tests/rl/test_advantages.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, RunConfig, TrainerConfig, load_config
from rayrl.orchestration.schedules import schedule_kind
from rayrl.resolve import resolve_algorithm
from rayrl.rl.loss_settings import clip_range, default_tis_cap, loss_aggregation
from rayrl.rl.objective import Objective, TokenBatch
from rayrl.rl.policy_losses import MAX_LOG_RATIO, PolicyLossInput, cispo, gspo, kl_estimate, ppo_clip
from rayrl.rl.shaping import overlong_penalty
from rayrl.rl.updates import UpdatePlan
from rayrl.trainers.lr_schedule import lr_at, total_optimizer_steps
from rayrl.types import Sample


def _inp(logp, old, adv, seq=None, **clip) -> PolicyLossInput:
    logp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    seq = torch.tensor(seq if seq is not None else [0] * len(adv))
    return PolicyLossInput(logp, torch.tensor(old, dtype=torch.float32), torch.tensor(adv, dtype=torch.float32),
                           seq, int(seq.max()) + 1, **clip)


# -- dual-clip -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("log_ratio", [2.0, -2.3])
def test_dual_clip_leaves_positive_advantages_alone(log_ratio):
    """A > 0: PPO's clipped loss whatever c is (c |A| as a bound would lower the loss to -3 and, for a small
    ratio, take away a gradient PPO keeps)."""
    kw = dict(clip_low=0.2, clip_high=0.28)
    plain = ppo_clip(_inp([log_ratio], [0.0], [1.0], **kw))
    x = _inp([log_ratio], [0.0], [1.0], dual_clip_c=3.0, **kw)
    dual = ppo_clip(x)
    assert dual.per_token.item() == pytest.approx(plain.per_token.item(), abs=1e-6)
    ratio = math.exp(log_ratio)
    assert dual.per_token.item() == pytest.approx(max(-ratio, -min(max(ratio, 0.8), 1.28)), abs=1e-5)
    dual.per_token.sum().backward()
    expected_grad = 0.0 if ratio > 1.28 else -ratio  # above the band: clipped; below it (A > 0): PPO keeps it
    assert x.logp.grad.item() == pytest.approx(expected_grad, abs=1e-5)
    assert dual.clipped.item() == plain.clipped.item()


def test_dual_clip_bound_is_c_times_the_advantage_for_negative_advantages():
    x = _inp([0.0], [-3.0], [-2.0], clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)  # ratio e^3 = 20
    assert ppo_clip(x).per_token.item() == pytest.approx(6.0)  # min(20 * 2, 3 * 2)


# -- log-ratio clamps ------------------------------------------------------------------------------------------------

def test_ppo_and_cispo_clamp_the_log_ratio_before_exp():
    # A < 0 with a log-ratio of 100: unclamped exp(100) is inf in float32; clamped, exp(20) = 4.85e8
    out = ppo_clip(_inp([100.0], [0.0], [-1.0], clip_low=0.2, clip_high=0.28))
    assert MAX_LOG_RATIO == 20.0
    assert out.per_token.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    low = ppo_clip(_inp([-100.0], [0.0], [1.0], clip_low=0.2, clip_high=0.28))
    assert low.per_token.item() == pytest.approx(-math.exp(-20.0), rel=1e-5)  # not exp(-100) = 0
    w = cispo(_inp([-100.0], [0.0], [1.0], clip_low=0.99, clip_high=4.0))
    assert w.per_token.item() == pytest.approx(-0.01 * 1.0 * -100.0, rel=1e-5)  # weight clamp(e^-20, 0.01, 5)
    big = cispo(_inp([0.0], [-100.0], [1.0], clip_low=1.0, clip_high=4.0))
    assert torch.isfinite(big.per_token).all()
    # no lower bound (low 1.0): the clamped weight is e^-20, not exp(-100) = 0: -w * A * logp = 100 e^-20
    tiny = cispo(_inp([-100.0], [0.0], [1.0], clip_low=1.0, clip_high=4.0))
    assert tiny.per_token.item() == pytest.approx(100.0 * math.exp(-20.0), rel=1e-4)


def test_gspo_clamps_the_sequence_log_ratio_at_10():
    x = _inp([30.0, 30.0], [0.0, 0.0], [-1.0, -1.0], [0, 0], clip_low=3e-4, clip_high=4e-4)
    out = gspo(x)
    assert out.per_token.tolist() == pytest.approx([math.exp(10.0)] * 2, rel=1e-5)


def test_tis_weight_clamps_its_log_ratio_and_caps_the_weight():
    obj = Objective(AlgorithmConfig(tis_cap=2.0))
    s = Sample(tokens=np.arange(3), prompt_length=2, loss_mask=np.ones(1), rollout_logprobs=np.array([-100.0]),
               policy_versions=np.zeros(1))
    tb = TokenBatch.from_fields(obj.token_fields([s], [1.0], UpdatePlan.single([s]).minibatches[0]), 1,
                                torch.device("cpu"))
    loss, stats = obj.loss(tb, torch.tensor([0.0]))
    assert stats["tis"].item() == 2.0 and math.isfinite(loss.item())
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-100.0]), "k3").item() == 10.0


# -- the KL terms and TIS --------------------------------------------------------------------------------------------

def _one_sample_batch(obj: Objective, rollout: list[float], adv: float, ref: list[float]) -> TokenBatch:
    n = len(rollout)
    s = Sample(tokens=np.arange(2 + n), prompt_length=2, loss_mask=np.ones(n), rollout_logprobs=np.array(rollout),
               policy_versions=np.zeros(n))
    tb = TokenBatch.from_fields(obj.token_fields([s], [adv], UpdatePlan.single([s]).minibatches[0]), 1,
                                torch.device("cpu"))
    tb.ref_logp = torch.tensor(ref)
    return tb


def test_no_gradient_flows_through_the_kl_penalty_in_the_reward():
    """The penalty shapes the advantage (a constant of the loss): the gradient is the policy loss's with the
    shaped advantages, nothing more. Through logp it would add -beta * A-independent terms."""
    ref, rollout = [-1.5, -0.5], [-1.0, -1.0]
    for proximal in (None, torch.tensor([-1.2, -0.8])):
        obj = Objective(AlgorithmConfig(kl_reward_coef=0.5))
        tb = _one_sample_batch(obj, rollout, 1.0, ref)
        tb.proximal = proximal
        logp = torch.tensor([-1.0, -1.0], requires_grad=True)
        loss, _ = obj.loss(tb, logp)
        loss.backward()
        prox = logp.detach() if proximal is None else proximal
        shaped = 1.0 - 0.5 * (prox - torch.tensor(ref))
        x = PolicyLossInput(logp.detach().clone().requires_grad_(True), torch.tensor(rollout), shaped,
                            torch.zeros(2, dtype=torch.int64), 1, 0.2, 0.28)
        (ppo_clip(x).per_token.sum() / 2).backward()
        assert logp.grad.tolist() == pytest.approx(x.logp.grad.tolist(), abs=1e-6)


def test_the_kl_loss_is_not_weighted_by_tis():
    """With A = 0 the policy loss is 0, so the loss is beta * mean(k3) whatever the TIS weights are."""
    ref = [-1.5, -0.5]
    obj = Objective(AlgorithmConfig(kl_loss_coef=0.1, tis_cap=2.0))
    tb = _one_sample_batch(obj, [-3.0, -0.2], 0.0, ref)  # TIS weights min(e^2, 2) = 2, e^-0.8
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, stats = obj.loss(tb, logp)
    k3 = kl_estimate(torch.tensor([-1.0, -1.0]), torch.tensor(ref), "k3")
    assert loss.item() == pytest.approx(0.1 * k3.mean().item(), abs=1e-7)
    assert stats["tis"].item() == pytest.approx(2.0 + math.exp(-0.8), abs=1e-5)
    loss.backward()
    d = torch.tensor(ref) - torch.tensor([-1.0, -1.0])  # k3's gradient: 1 - exp(ref - logp)
    assert logp.grad.tolist() == pytest.approx((0.1 * (1 - torch.exp(d)) / 2).tolist(), abs=1e-6)


# -- every default ---------------------------------------------------------------------------------------------------

ALGORITHM_DEFAULTS = {
    "advantage_estimator": "grpo", "grpo_std": "population", "singleton_groups": "zero", "policy_loss": "ppo_clip",
    "loss_agg": "auto", "loss_agg_norm": 0, "clip_eps": None, "clip_eps_high": None, "dual_clip_c": 0.0,
    "tis_cap": None, "entropy_coef": 0.0, "kl_loss_coef": 0.0, "kl_loss_type": "k3", "kl_reward_coef": 0.0,
    "reference_path": None, "sft_coef": 0.0, "sft_min_reward": None, "dynamic_sampling": False,
    "dynamic_sampling_max_groups": 0, "overlong_max_tokens": 0, "overlong_buffer_tokens": 0,
    "overlong_penalty": 1.0, "distill_teacher": None, "distill_coef": 1.0,
}


def test_every_algorithm_default():
    algo = AlgorithmConfig()
    assert {f.name: getattr(algo, f.name) for f in dataclasses.fields(algo)} == ALGORITHM_DEFAULTS


@pytest.mark.parametrize("estimator, loss, agg", [
    ("grpo", "ppo_clip", "token_mean"),
    ("dr_grpo", "ppo_clip", "seq_mean_token_sum_norm"),  # Dr.GRPO's constant normaliser
    ("grpo", "gspo", "seq_mean_token_mean"),  # GSPO's sequence mean
    ("dr_grpo", "gspo", "seq_mean_token_mean"),  # the loss's choice wins
    ("rloo", "cispo", "token_mean"),
    ("reinforce_pp", "sft", "token_mean"),
])
def test_loss_agg_auto(estimator, loss, agg):
    algo = AlgorithmConfig(advantage_estimator=estimator, policy_loss=loss)
    assert loss_aggregation(algo) == agg
    assert loss_aggregation(dataclasses.replace(algo, loss_agg="seq_mean_token_sum")) == "seq_mean_token_sum"


@pytest.mark.parametrize("loss, band", [("ppo_clip", (0.2, 0.28)), ("gspo", (3e-4, 4e-4)), ("cispo", (1.0, 4.0)),
                                        ("sft", (0.2, 0.28)), ("tests.rl.test_objective:recording_ppo", (0.2, 0.28))])
def test_clip_bands(loss, band):
    assert clip_range(AlgorithmConfig(policy_loss=loss)) == band
    assert clip_range(AlgorithmConfig(policy_loss=loss, clip_eps=0.1)) == (0.1, band[1])
    assert clip_range(AlgorithmConfig(policy_loss=loss, clip_eps_high=0.5)) == (band[0], 0.5)


def _tis(algo: AlgorithmConfig, schedule: str) -> float:
    return default_tis_cap(algo, schedule_kind(schedule).tis_cap)


def test_tis_cap_by_schedule_and_loss():
    assert _tis(AlgorithmConfig(), "sync") == 0.0
    assert _tis(AlgorithmConfig(), "async") == 2.0
    assert _tis(AlgorithmConfig(), "colocated_async") == 2.0
    assert _tis(AlgorithmConfig(policy_loss="gspo"), "sync") == 2.0  # its band is narrower than the gap
    assert _tis(AlgorithmConfig(policy_loss="gspo"), "async") == 2.0
    assert _tis(AlgorithmConfig(policy_loss="cispo"), "sync") == 0.0


def test_resolved_algorithm_defaults_the_dr_grpo_constant_and_dynamic_sampling_bound():
    cfg = load_config(None, ["algorithm.advantage_estimator=dr_grpo", "rollout.max_turns=3",
                             "rollout.max_tokens=100", "rollout.prompts_per_step=5"])
    algo = resolve_algorithm(cfg)
    assert algo.loss_agg == "seq_mean_token_sum_norm" and algo.loss_agg_norm == 300  # max_turns x max_tokens
    assert algo.dynamic_sampling_max_groups == 20  # 4 x prompts_per_step
    assert algo.clip_eps == 0.2 and algo.clip_eps_high == 0.28 and algo.tis_cap == 0.0
    assert algo.reference_path == cfg.model.path
    set_norm = load_config(None, ["algorithm.advantage_estimator=dr_grpo", "algorithm.loss_agg_norm=7"])
    assert resolve_algorithm(set_norm).loss_agg_norm == 7
    obj = Objective(dataclasses.replace(algo))
    s = [Sample(tokens=np.arange(5), prompt_length=2, loss_mask=np.ones(3), rollout_logprobs=np.zeros(3),
                policy_versions=np.zeros(3))]
    assert obj.sample_weight(3, UpdatePlan.single(s).minibatches[0]) == pytest.approx(1 / 300)


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    cfg = TrainerConfig(lr=1.0, steps=3, num_steps_per_rollout=2, epochs_per_rollout=2, lr_warmup_steps=1,
                        lr_schedule="cosine", lr_min_ratio=0.0)
    assert total_optimizer_steps(cfg) == 12
    lrs = [lr_at(i, cfg) for i in range(12)]
    assert lrs[0] == 1.0 and lrs[-1] == pytest.approx(0.0, abs=1e-12)  # the floor exactly at the last step
    assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 10)))  # halfway: (6 - 1) / (12 - 1 - 1)
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))  # decays every step, not only over steps x minibatches


def test_trainer_defaults_that_shape_the_update():
    t = RunConfig().trainer
    assert (t.num_steps_per_rollout, t.epochs_per_rollout, t.lr_schedule, t.lr_warmup_steps, t.lr_min_ratio) == (
        1, 1, "constant", 0, 0.0)


def test_the_overlong_penalty_past_the_limit_is_the_configured_penalty():
    assert overlong_penalty(150, 100, 20, scale=0.5) == -0.5  # not -1: overlong_penalty scales the whole penalty
    assert overlong_penalty(100, 100, 20, scale=0.5) == pytest.approx(-0.5)  # the linear part meets it at the limit
