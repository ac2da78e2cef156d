"""Every policy loss, KL estimator and the entropy (rayrl/rl/policy_losses.py) against values and
gradients worked out by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from rayrl.config import ConfigError
from rayrl.machine import Machine
from rayrl.resolve import load_checked, resolve
from rayrl.rl.policy_losses import (
    POLICY_LOSSES,
    PolicyLossInput,
    PolicyLossOutput,
    cispo,
    entropy_from_logits,
    gspo,
    kl_estimate,
    loss_traits,
    policy_loss,
    ppo_clip,
    sft,
)
from rayrl.trainers.megatron_packing import sharded_entropy


def _inp(logp, old, adv, seq=None, **clip) -> PolicyLossInput:
    logp = torch.tensor(logp, requires_grad=True)
    seq = torch.tensor(seq if seq is not None else [0] * len(adv))
    return PolicyLossInput(logp, torch.tensor(old), torch.tensor(adv), seq, int(seq.max()) + 1, **clip)


def test_ppo_clip_by_hand():
    # ratios exp(0.5) = 1.6487 (A > 0: clipped at 1.28), exp(-0.5) = 0.6065 (A < 0: clipped at 0.8), 1 (A > 0)
    x = _inp([-1.0, -2.0, -0.5], [-1.5, -1.5, -0.5], [2.0, -1.0, 0.5], clip_low=0.2, clip_high=0.28)
    out = ppo_clip(x)
    assert out.per_token.tolist() == pytest.approx([-2.56, 0.8, -0.5], abs=1e-5)
    assert out.clipped.tolist() == [1.0, 1.0, 0.0]
    out.per_token.sum().backward()
    # clipped tokens carry no gradient; token 3: d/dlogp of -A * exp(logp - old) = -A * ratio = -0.5
    assert x.logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5], abs=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # A = -1 with ratio e^2 = 7.39: PPO's loss would be 7.39 (no clip applies upward); dual-clip c = 3
    # caps it at 3 |A| = 3 (no gradient). Ratio 2 (log 0.693): loss 2 < 3, untouched, gradient -A r = 2.
    x = _inp([0.0, math.log(2.0)], [-2.0, 0.0], [-1.0, -1.0], clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    out = ppo_clip(x)
    assert out.per_token.tolist() == pytest.approx([3.0, 2.0], abs=1e-5)
    assert out.clipped.tolist() == [1.0, 0.0]
    out.per_token.sum().backward()
    assert x.logp.grad.tolist() == pytest.approx([0.0, 2.0], abs=1e-5)
    plain = ppo_clip(_inp([0.0], [-2.0], [-1.0], clip_low=0.2, clip_high=0.28))
    assert plain.per_token.item() == pytest.approx(math.exp(2.0), abs=1e-4)


def test_gspo_uses_one_ratio_per_sequence():
    # sequence 0: token log-ratios 0.2, -0.1, 0.2 -> mean 0.1, s0 = e^0.1 = 1.10517
    # sequence 1: -0.4, 0.0 -> mean -0.2, s1 = e^-0.2 = 0.81873
    logp, old = [0.2, -0.1, 0.2, -0.4, 0.0], [0.0] * 5
    x = _inp(logp, old, [1.0] * 3 + [-2.0] * 2, [0, 0, 0, 1, 1], clip_low=0.5, clip_high=0.5)
    out = gspo(x)
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    assert out.per_token.tolist() == pytest.approx([-s0] * 3 + [2 * s1] * 2, abs=1e-5)
    out.per_token.sum().backward()
    # GSPO-token: d/dlogp_t = -A * s (the sequence ratio), for every token of the sequence
    assert x.logp.grad.tolist() == pytest.approx([-s0] * 3 + [2 * s1] * 2, abs=1e-5)
    # a narrow band clips whole sequences: 1.105 > 1 + 0.1 with A > 0; 0.819 < 1 - 0.1 with A < 0
    narrow = gspo(_inp(logp, old, [1.0] * 3 + [-2.0] * 2, [0, 0, 0, 1, 1], clip_low=0.1, clip_high=0.1))
    assert narrow.per_token.tolist() == pytest.approx([-1.1] * 3 + [1.8] * 2, abs=1e-5)
    assert narrow.clipped.tolist() == [1.0] * 5


def test_cispo_clips_the_weight_not_the_gradient():
    # ratios 1, e^2 = 7.39 (capped at 1 + 4 = 5), e^-0.5 = 0.61 (no lower bound with low = 1)
    x = _inp([-1.0, -0.5, -2.0], [-1.0, -2.5, -1.5], [1.0, 1.0, -1.0], clip_low=1.0, clip_high=4.0)
    out = cispo(x)
    w = math.exp(-0.5)
    assert out.per_token.tolist() == pytest.approx([1.0 * -1 * -1.0, -5.0 * -0.5, -(w * -1.0 * -2.0)], abs=1e-5)
    assert out.clipped.tolist() == [0.0, 1.0, 0.0]
    out.per_token.sum().backward()
    assert x.logp.grad.tolist() == pytest.approx([-1.0, -5.0, w], abs=1e-5)  # -sg(w) * A: clipped keeps its gradient


def test_sft_is_the_negative_log_likelihood():
    x = _inp([-1.0, -3.0], [0.0, 0.0], [5.0, -5.0])
    out = sft(x)
    assert out.per_token.tolist() == [1.0, 3.0]
    out.per_token.sum().backward()
    assert x.logp.grad.tolist() == [-1.0, -1.0]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1.0, 0.0], abs=1e-6)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-30.0]), "k3").item() == 10.0  # clamped as the peers do
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(logp, ref, "k4")


def test_entropy_whole_and_split_over_vocabulary_shards():
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))
    torch.manual_seed(0)
    logits = torch.randn(3, 10, requires_grad=True)
    whole = entropy_from_logits(logits)
    (whole * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    expected_grad = logits.grad.clone()
    # two tensor-parallel shards of 5 vocabulary entries; each "rank" all-reduces by adding the other's
    # partial sums (constants to it, as an all-reduce's backward passes the gradient to its own part only)
    shards = [logits.detach()[:, :5].clone().requires_grad_(), logits.detach()[:, 5:].clone().requires_grad_()]
    global_max = logits.detach().max(-1, keepdim=True).values
    partial = []
    for shard in shards:
        e = torch.exp(shard.detach() - global_max)
        partial.append(torch.stack([e.sum(-1), (e * shard.detach()).sum(-1)]))
    for r, shard in enumerate(shards):
        ent = sharded_entropy(shard, lambda t, o=partial[1 - r]: t + o, lambda t: global_max)
        assert torch.allclose(ent, whole.detach(), atol=1e-5)
        (ent * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.allclose(torch.cat([s.grad for s in shards], dim=-1), expected_grad, atol=1e-5)


def my_loss(x: PolicyLossInput) -> PolicyLossOutput:
    """A loss of one's own (module:function): plain REINFORCE."""
    return PolicyLossOutput(-x.advantages * x.logp, (x.logp * 0).detach())


@loss_traits(clip=(0.1, 0.15), aggregation="seq_mean_token_mean", whole_sequence=True, narrow_band=True)
def my_sequence_loss(x: PolicyLossInput) -> PolicyLossOutput:
    """A loss of one's own that declares its traits: GSPO's formula with a band of its own."""
    return gspo(x)


MINE = "algorithm.policy_loss=tests.rl.test_policy_losses:"
MACHINE = Machine(cores=2, cuda=False)


def test_a_loss_of_ones_own_and_unknown_names():
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo", "sft"}
    cfg = load_checked(None, [MINE + "my_loss", "algorithm.clip_eps=0.1", "algorithm.clip_eps_high=0.3"])
    assert cfg.algorithm.policy_loss == "tests.rl.test_policy_losses:my_loss"
    with pytest.raises(ConfigError,
                       match="^algorithm.policy_loss: unknown 'ppo'; registered: cispo, gspo, ppo_clip, sft"):
        load_checked(None, ["algorithm.policy_loss=ppo"])


def test_a_loss_of_ones_own_gets_no_band_it_did_not_declare():
    """A loss of one's own used to get ppo_clip's band (0.2, 0.28) silently; undeclared, the run must set it."""
    with pytest.raises(ConfigError, match="^algorithm.clip_eps: the policy loss tests.rl.test_policy_losses:my_loss "
                                          "declares no clip band"):
        load_checked(None, [MINE + "my_loss"])
    with pytest.raises(ConfigError, match="^algorithm.clip_eps_high: the policy loss"):
        load_checked(None, [MINE + "my_loss", "algorithm.clip_eps=0.1"])
    algo = resolve(load_checked(None, [MINE + "my_loss", "algorithm.clip_eps=0.1", "algorithm.clip_eps_high=0.3"]),
                   MACHINE).algorithm
    assert (algo.clip_eps, algo.clip_eps_high, algo.loss_agg, algo.tis_cap) == (0.1, 0.3, "token_mean", 0.0)
    assert policy_loss("tests.rl.test_policy_losses:my_loss").dual_clip  # dual_clip_c is passed on, as before


def test_a_loss_of_ones_own_declares_its_traits():
    """Every trait a built-in row carries, declared with loss_traits: band, aggregation, whole sequences,
    narrow band (TIS on in a sync run)."""
    algo = resolve(load_checked(None, [MINE + "my_sequence_loss"]), MACHINE).algorithm
    assert (algo.clip_eps, algo.clip_eps_high, algo.loss_agg, algo.tis_cap) == (0.1, 0.15, "seq_mean_token_mean", 2.0)
    with pytest.raises(ConfigError, match="^algorithm.policy_loss: tests.rl.test_policy_losses:my_sequence_loss's "
                                          "sequence-level ratio needs whole sequences"):
        load_checked(None, [MINE + "my_sequence_loss", "trainer.backend=megatron", "trainer.cp_size=2",
                            "trainer.num_ranks=2", "trainer.megatron_layer_spec=transformer_engine"])
    row = policy_loss("tests.rl.test_policy_losses:my_sequence_loss")
    assert row.fn.__name__ == "my_sequence_loss" and not row.supervised and row.dual_clip
    with pytest.raises(ConfigError, match="^algorithm.dual_clip_c: applies to ppo_clip only"):
        load_checked(None, ["algorithm.policy_loss=gspo", "algorithm.dual_clip_c=3"])


def half_ppo(x: PolicyLossInput) -> PolicyLossOutput:
    """PPO's clipped surrogate at half the weight: the example of docs/contributing.md."""
    out = ppo_clip(x)
    return PolicyLossOutput(0.5 * out.per_token, out.clipped)


def test_a_new_row_is_all_a_loss_needs(monkeypatch):
    """docs/contributing.md: a loss is one function and one row; the check, resolve and the trainer's loss helper
    take everything else from the row's traits."""
    from rayrl.rl import policy_losses
    from rayrl.rl.objective import Objective

    row = policy_losses.PolicyLoss("half_ppo", half_ppo, clip=policy_losses.PPO_BAND,
                                   aggregation="seq_mean_token_sum", dual_clip=True)
    monkeypatch.setitem(policy_losses.POLICY_LOSSES, "half_ppo", row)
    cfg = resolve(load_checked(None, ["algorithm.policy_loss=half_ppo", "algorithm.dual_clip_c=3"]), MACHINE)
    algo = cfg.algorithm
    assert (algo.clip_eps, algo.clip_eps_high, algo.loss_agg, algo.tis_cap) == (0.2, 0.28, "seq_mean_token_sum", 0.0)
    objective = Objective(algo)
    assert objective.policy_loss is half_ppo and objective.aggregation == "seq_mean_token_sum"
    with pytest.raises(ConfigError, match="^algorithm.policy_loss: unknown 'half_ppo'"):
        monkeypatch.delitem(policy_losses.POLICY_LOSSES, "half_ppo")
        load_checked(None, ["algorithm.policy_loss=half_ppo"])
