"""The one loss helper (rayrl/rl/objective.py): every aggregation by hand and split over ranks,
TIS, the KL terms, the entropy bonus, the SFT term; the update plan (rayrl/rl/updates.py); the
learning-rate schedule; and the torch trainer making several updates per batch with the ratio taken
against the right policy and a reference model."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, ConfigError, RunConfig, TrainerConfig, load_config
from rayrl.resolve import check
from rayrl.rl.objective import Objective, TokenBatch
from rayrl.rl.policy_losses import PPO_BAND, PolicyLossInput, PolicyLossOutput, loss_traits, ppo_clip
from rayrl.rl.updates import MiniBatch, UpdatePlan, plan_updates, sample_trains
from rayrl.trainers.lr_schedule import lr_at
from rayrl.types import Sample


def _sample(trained: int, reward: float = 0.0, prompt: int = 2, rollout: float = -1.0) -> Sample:
    return Sample(tokens=np.arange(prompt + trained), prompt_length=prompt, loss_mask=np.ones(trained),
                  rollout_logprobs=np.full(trained, rollout), policy_versions=np.zeros(trained), reward=reward)


def _tokens(obj: Objective, samples, advantages, mb: MiniBatch | None = None) -> TokenBatch:
    mb = mb or UpdatePlan.single(samples).minibatches[0]
    return TokenBatch.from_fields(obj.token_fields(samples, advantages, mb), len(samples), torch.device("cpu"))


# sequence 0 has 1 trained token, sequence 1 has 3; with the sft loss each token's loss is -logp = 1, 2, 3, 4
LOGP = [-1.0, -2.0, -3.0, -4.0]


@pytest.mark.parametrize("agg, expected", [
    ("token_mean", (1 + 2 + 3 + 4) / 4),
    ("seq_mean_token_mean", (1 + (2 + 3 + 4) / 3) / 2),
    ("seq_mean_token_sum", (1 + 9) / 2),
    ("seq_mean_token_sum_norm", (1 + 9) / (2 * 10)),  # Dr.GRPO: a constant C = 10 instead of the lengths
])
def test_aggregations_by_hand(agg, expected):
    obj = Objective(AlgorithmConfig(policy_loss="sft", loss_agg=agg, loss_agg_norm=10))
    samples = [_sample(1), _sample(3)]
    loss, stats = obj.loss(_tokens(obj, samples, [1.0, 1.0]), torch.tensor(LOGP))
    assert loss.item() == pytest.approx(expected)
    assert stats["tokens"].item() == 4


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_the_global_normalisers_make_ranks_add_up(agg):
    """Each sequence trained on another rank (or micro-batch), with the mini-batch's global sizes: the
    parts sum to the whole mini-batch's loss and gradient."""
    obj = Objective(AlgorithmConfig(advantage_estimator="dr_grpo", loss_agg=agg, loss_agg_norm=10))
    samples, adv = [_sample(1), _sample(3)], [1.5, -0.5]
    whole_logp = torch.tensor(LOGP, requires_grad=True)
    whole, _ = obj.loss(_tokens(obj, samples, adv), whole_logp)
    whole.backward()
    mb = MiniBatch((0,), tokens=4, sequences=2)  # the global sizes, as plan_updates gives every rank
    parts = []
    for s, a, lp in ((samples[0], adv[0], LOGP[:1]), (samples[1], adv[1], LOGP[1:])):
        logp = torch.tensor(lp, requires_grad=True)
        loss, _ = obj.loss(_tokens(obj, [s], [a], mb), logp)
        loss.backward()
        parts.append((loss.item(), logp.grad))
    assert sum(p[0] for p in parts) == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(torch.cat([p[1] for p in parts]), whole_logp.grad)


def test_tis_weights_against_the_proximal_policy():
    obj = Objective(AlgorithmConfig(tis_cap=2.0))
    samples = [_sample(1, rollout=-3.0), _sample(1, rollout=-0.9)]
    tb = _tokens(obj, samples, [1.0, 1.0])
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, stats = obj.loss(tb, logp)
    # ratio against logp.detach() is 1 (one update); weights exp(2) capped at 2, exp(-0.1); token mean
    assert loss.item() == pytest.approx(-(2.0 + math.exp(-0.1)) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -math.exp(-0.1) / 2], abs=1e-6)
    assert stats["tis"].item() == pytest.approx(2.0 + math.exp(-0.1), abs=1e-6)


def test_without_tis_the_ratio_is_against_the_rollout():
    obj = Objective(AlgorithmConfig(tis_cap=0.0))
    loss, stats = obj.loss(_tokens(obj, [_sample(1, rollout=-1.5)], [2.0]), torch.tensor([-1.0]))
    assert loss.item() == pytest.approx(-2.56) and stats["clip"].item() == 1  # exp(0.5) clipped at 1.28


def test_gspo_is_not_clipped_by_the_engine_gap_when_its_ratio_is_the_trainers():
    """One sequence of 4 tokens whose engine log-probs sit 1e-3 below the trainer's (an fp16 engine's gap):
    against the rollout its sequence ratio is exp(1e-3), past GSPO's 1 + 4e-4, so the whole sequence is
    clipped and gives no gradient; against the trainer's own log-probs (tis_cap > 0, what resolve gives
    gspo by default) the ratio is 1, nothing is clipped, and TIS weighs each token by exp(1e-3)."""
    gap_logp = [-1.0, -2.0, -3.0, -4.0]
    sample = Sample(tokens=np.arange(6), prompt_length=2, loss_mask=np.ones(4),
                    rollout_logprobs=np.array(gap_logp) - 1e-3, policy_versions=np.zeros(4), reward=1.0)
    for tis_cap, clipped in ((0.0, 1.0), (2.0, 0.0)):
        obj = Objective(AlgorithmConfig(policy_loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4,
                                        loss_agg="seq_mean_token_mean", tis_cap=tis_cap))
        logp = torch.tensor(gap_logp, requires_grad=True)
        loss, stats = obj.loss(_tokens(obj, [sample], [1.0]), logp)
        loss.backward()
        assert stats["clip"].item() / 4 == clipped
        if clipped:
            assert logp.grad.abs().max().item() == 0.0
            assert loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)  # the clipped value, A = 1
        else:
            assert logp.grad.tolist() == pytest.approx([-math.exp(1e-3) / 4] * 4, abs=1e-6)


def test_kl_loss_and_kl_in_reward():
    samples = [_sample(2)]
    ref = torch.tensor([-1.5, -1.0])
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    obj = Objective(AlgorithmConfig(policy_loss="sft", kl_loss_coef=0.1, kl_loss_type="k1"))
    tb = _tokens(obj, samples, [0.0])
    tb.ref_logp = ref
    loss, stats = obj.loss(tb, logp)
    # sft: mean(1, 1) = 1; k1 = logp - ref = 0.5, 0 -> + 0.1 * mean = 0.025
    assert loss.item() == pytest.approx(1.0 + 0.025)
    assert stats["ref_kl"].item() == pytest.approx(0.5)
    # KL in the reward: A_t - 0.5 * (proximal - ref) with proximal = logp here: advantages 1 - 0.25, 1 - 0
    obj = Objective(AlgorithmConfig(kl_reward_coef=0.5))
    tb = _tokens(obj, samples, [1.0])
    tb.ref_logp = ref
    seen = {}
    obj.policy_loss = lambda x: seen.setdefault("x", x) and ppo_clip(x)
    obj.loss(tb, logp)
    assert seen["x"].advantages.tolist() == pytest.approx([0.75, 1.0])
    with pytest.raises(RuntimeError, match="no reference log-probs"):
        obj.loss(_tokens(obj, samples, [1.0]), logp)


def test_entropy_bonus_and_sft_term():
    samples = [_sample(2, reward=1.0), _sample(2, reward=0.0)]
    logp = torch.tensor([-1.0, -1.0, -2.0, -2.0], requires_grad=True)
    entropy = torch.tensor([0.5, 0.5, 1.0, 1.0])
    obj = Objective(AlgorithmConfig(entropy_coef=0.1, sft_coef=0.5, sft_min_reward=1.0))
    tb = _tokens(obj, samples, [0.0, 0.0])  # no policy-gradient signal: only the two terms
    assert tb.sft.tolist() == [1.0, 1.0, 0.0, 0.0]  # only the rewarded sample gets the SFT term
    loss, stats = obj.loss(tb, logp, entropy)
    # token mean of -0.1 * H + 0.5 * (-logp) on the rewarded sample: (-0.05 - 0.05 - 0.1 - 0.1 + 0.5 + 0.5) / 4
    assert loss.item() == pytest.approx(0.7 / 4)
    assert stats["entropy"].item() == pytest.approx(3.0)


def test_which_samples_train():
    algo = AlgorithmConfig()
    assert sample_trains(_sample(2), 1.0, algo) and not sample_trains(_sample(2), 0.0, algo)
    assert not sample_trains(_sample(0), 1.0, algo)  # nothing trained in it
    assert sample_trains(_sample(2), np.array([0.0, 0.3]), algo)  # per-token advantages
    assert sample_trains(_sample(2), 0.0, AlgorithmConfig(kl_loss_coef=0.1))  # a regulariser acts anyway
    rft = AlgorithmConfig(policy_loss="sft", sft_min_reward=1.0)
    assert sample_trains(_sample(2, reward=1.0), 0.0, rft) and not sample_trains(_sample(2, reward=0.5), 9.0, rft)


def test_update_plan_over_ranks_and_mini_batches():
    samples = [_sample(n) for n in (4, 2, 6, 1, 3, 5, 2)]
    adv = [1.0, -1.0, 0.0, 1.0, -1.0, 1.0, -1.0]  # sample 2 trains nothing
    plans = plan_updates(samples, adv, AlgorithmConfig(), world_size=2, num_minibatches=2, epochs=3)
    assert [p.optimizer_steps for _, p in plans] == [6, 6]
    trained = sorted(i for idx, _ in plans for i in idx)
    assert trained == [0, 1, 3, 4, 5, 6]  # every trained sample once, on one rank
    # mini-batch 0 is samples 0, 1, 3 (4 + 2 + 1 tokens), mini-batch 1 is 4, 5, 6 (3 + 5 + 2)
    for idx, plan in plans:
        assert [(mb.tokens, mb.sequences) for mb in plan.minibatches] == [(7, 3), (10, 3)]
        for mb in plan.minibatches:
            assert all(0 <= i < len(idx) for i in mb.indices)
    tp = plan_updates(samples, adv, AlgorithmConfig(), world_size=4, tp=2, num_minibatches=1)
    assert tp[0][0] == tp[1][0] and tp[2][0] == tp[3][0]  # the ranks of a replica train the same samples
    nothing = plan_updates(samples, [0.0] * 7, AlgorithmConfig())
    assert nothing[0][0] == [] and nothing[0][1].optimizer_steps == 1  # still one (empty) step


def test_learning_rate_schedule():
    cfg = TrainerConfig(lr=1.0, steps=5, num_steps_per_rollout=2, lr_warmup_steps=2, lr_schedule="cosine",
                        lr_min_ratio=0.1)
    lrs = [lr_at(i, cfg) for i in range(10)]  # 10 optimizer steps in the run
    assert lrs[:2] == [0.5, 1.0]  # linear warm-up
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)  # cosine from lr to lr x 0.1
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))
    assert [lr_at(i, TrainerConfig(lr=3.0)) for i in range(3)] == [3.0, 3.0, 3.0]  # the default: constant


@pytest.mark.parametrize("key, hint", [
    ("trainer.loss=grpo", "algorithm.advantage_estimator"),
    ("trainer.kl_coef=0.1", "algorithm.kl_loss_coef"),
    ("trainer.normalize_advantage_std=false", "dr_grpo"),
    ("trainer.tis_cap=2", "algorithm.tis_cap"),
    ("trainer.clip_eps_high=0.3", "algorithm.clip_eps_high"),
])
def test_removed_keys_say_what_to_write(key, hint, tmp_path):
    with pytest.raises(ConfigError, match=f"^{key.split('=')[0]}: removed; .*{hint}"):
        load_config(None, [key])
    dotted, value = key.split("=")
    section, name = dotted.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{section}.{name}: removed; .*{hint}"):
        load_config(path)


RECORDED: list[PolicyLossInput] = []


@loss_traits(clip=PPO_BAND, dual_clip=True)
def recording_ppo(x: PolicyLossInput) -> PolicyLossOutput:
    """ppo_clip that keeps what it saw (module:function seam), for the test below."""
    RECORDED.append(PolicyLossInput(x.logp.detach().clone(), x.old_logp.clone(), x.advantages, x.seq_index,
                                    x.num_seqs, x.clip_low, x.clip_high))
    return ppo_clip(x)


def test_several_updates_use_the_proximal_policy_and_the_reference(tiny_model_dir):
    from rayrl.trainers.torch_backend import TorchTrainer

    algo = AlgorithmConfig(policy_loss="tests.rl.test_objective:recording_ppo", tis_cap=2.0, kl_loss_coef=0.05)
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=4096, compute_dtype="float32", num_steps_per_rollout=2,
                        epochs_per_rollout=2, steps=3)
    trainer = TorchTrainer(tiny_model_dir, cfg, algorithm=algo, seed=0, device="cpu")
    assert trainer.reference is not None and not any(p.requires_grad for p in trainer.reference.parameters())
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(4):
        tokens = rng.integers(10, 4000, size=20).astype(np.int32)
        samples.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(12), policy_versions=np.zeros(12),
                              rollout_logprobs=np.full(12, -20.0, np.float32)))
    recorded = importlib.import_module("tests.rl.test_objective").RECORDED  # the module the seam imported
    recorded.clear()
    (keep, plan), = plan_updates(samples, [1.0, -1.0, 1.0, -1.0], algo, num_minibatches=2, epochs=2)
    metrics = trainer.train_step([samples[i] for i in keep], [[1.0, -1.0, 1.0, -1.0][i] for i in keep], plan)
    assert metrics["optimizer_steps"] == 4 and metrics["policy_version"] == 1 and trainer.optimizer_steps == 4
    assert len(recorded) == 4  # one micro-batch per mini-batch, two epochs
    first_lp, rollout_lp = trainer.objective.first_forward_logprobs()
    assert len(first_lp) == 4 * 12 and torch.all(rollout_lp == -20.0)  # every token, before any update
    # the ratio's denominator is the proximal policy (the pre-pass), at every update, not the current
    # weights: after the first update the two differ; and it is never the rollout's -20
    proximal = {0: first_lp[:24], 1: first_lp[24:]}
    for k, seen in enumerate(recorded):
        assert torch.allclose(seen.old_logp, proximal[k % 2])
    assert not torch.allclose(recorded[1].logp, recorded[1].old_logp, atol=1e-6)  # the weights moved
    assert metrics["ref_kl_mean"] > 0 and metrics["tis_weight_mean"] == pytest.approx(2.0)  # exp(lp + 20) capped
    # a second step starts its proximal policy afresh
    trainer.train_step([samples[i] for i in keep], [1.0, -1.0, 1.0, -1.0], plan)
    again, _ = trainer.objective.first_forward_logprobs()
    assert not torch.allclose(again, first_lp)


def test_the_sft_loss_is_not_weighted_by_tis_and_dual_clip_is_ppo_clips_only():
    """docs/algorithms.md "Conventions": the sft loss is a likelihood target (TIS would down-weight the very
    tokens the trainer now finds less likely); dual_clip_c with a loss that does not use it is refused."""
    obj = Objective(AlgorithmConfig(policy_loss="sft", tis_cap=2.0))
    tb = _tokens(obj, [_sample(1, rollout=-3.0), _sample(1, rollout=-0.5)], [1.0, 1.0])
    loss, stats = obj.loss(tb, torch.tensor([-1.0, -1.0]))
    assert loss.item() == pytest.approx(1.0)  # token mean of -logp, unweighted (TIS weights would be 2, e^-0.5)
    assert stats["tis"].item() == pytest.approx(2.0)  # weight 1 per token
    for loss_name in ("gspo", "cispo", "sft"):
        with pytest.raises(ConfigError, match="^algorithm.dual_clip_c: applies to ppo_clip only"):
            check(RunConfig(algorithm=AlgorithmConfig(policy_loss=loss_name, dual_clip_c=3.0)))
    assert check(RunConfig(algorithm=AlgorithmConfig(policy_loss="ppo_clip", dual_clip_c=3.0))).algorithm.dual_clip_c
