"""The ``algorithm`` section: what the trainer optimises, as opposed to how (``trainer``).

Every choice here is one line of config: the advantage estimator and the policy loss by registered
name or as ``package.module:function`` for your own (contracts: rayrl/rl/advantages.py and
rayrl/rl/policy_losses.py), how the per-token loss is aggregated, off-policy correction, the
KL to a frozen reference model, an entropy bonus, an SFT term, batch shaping (DAPO's dynamic
sampling and overlong reward shaping) and on-policy distillation from a teacher engine.
docs/algorithms.md has a table of every choice and the paper it follows.

Values that mean "auto" (``None``, 0, ``auto``) are made concrete by the resolve step, rayrl/resolve.py
(``resolve_algorithm``): the clip ranges and the aggregation each loss's paper uses, ``tis_cap`` by
schedule, the constant normaliser from the rollout budget. Names of estimators and losses are checked
by that step against their tables (a ``module:function`` is imported then; driver.py runs it before Ray
starts), so a typo fails naming the field; this module imports no table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from rayrl.config.checks import ConfigError, non_negative

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


LossAgg = Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


@dataclass
class AlgorithmConfig:
    """What is optimised: advantage estimator, policy loss and its aggregation, reference model, distillation,
    batch shaping (docs/algorithms.md)."""

    advantage_estimator: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline |
    # package.module:function (contract: rayrl/rl/advantages.py); gae needs a critic, which no backend holds yet (config
    # error)
    grpo_std: Literal["population", "sample"] = "population"  # grpo: the group's std, population (sqrt(sum/G), the
    # formula of DeepSeekMath and of rayrl before) or sample (sqrt(sum/(G-1)), as verl, TRL and slime compute it)
    singleton_groups: Literal["zero", "reward"] = "zero"  # a group estimator's advantage for a group left with one
    # scored episode (no baseline): zero (no signal), or reward (its raw reward, as verl does)
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | cispo | sft | package.module:function (contract:
    # rayrl/rl/policy_losses.py)
    loss_agg: LossAgg = "auto"  # how per-token losses become one number, over the whole mini-batch on every rank: auto
    # | token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (a constant normaliser, Dr.GRPO)
    # (auto: seq_mean_token_mean for gspo, seq_mean_token_sum_norm for dr_grpo, else token_mean)
    loss_agg_norm: int = 0  # seq_mean_token_sum_norm: the constant each sequence's token sum is divided by (0:
    # rollout.max_turns x rollout.max_tokens, the most tokens an episode can generate)
    clip_eps: Optional[float] = None  # lower clip range of the importance ratio (unset: ppo_clip 0.2, gspo 3e-4, cispo
    # 1.0 i.e. no lower bound)
    clip_eps_high: Optional[float] = None  # upper clip range (unset: ppo_clip 0.28 "clip-higher", gspo 4e-4, cispo 4.0)
    dual_clip_c: float = 0.0  # ppo_clip: dual-clip bound on the loss of negative-advantage tokens, c x |A| (> 1, 3.0 is
    # usual; 0: off); a config error with gspo, cispo and sft, which do not use it
    tis_cap: Optional[float] = None  # truncated importance sampling against the rollout log-probs: cap of the weight
    # (0: off); unset: 0 for sync, 2.0 for the async schedules and for gspo (its 3e-4 band needs the ratio against the
    # trainer's own log-probs: rayrl/resolve.py)
    entropy_coef: float = 0.0  # entropy bonus: subtract this x the policy's per-token entropy (aggregated like the
    # loss)
    kl_loss_coef: float = 0.0  # KL to the frozen reference model, in the loss (0: off; no reference is loaded unless a
    # KL is on)
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"  # the KL estimator in the loss: k1 | k2 | k3 (k3: low-variance,
    # exp(ref - logp) - (ref - logp) - 1)
    kl_reward_coef: float = 0.0  # KL penalty in the reward: each token's advantage minus this x k1(old policy,
    # reference) (0: off)
    reference_path: Optional[str] = None  # the reference model (unset: model.path, the initial weights); held on the
    # trainer ranks, freed with the trainer when it offloads
    sft_coef: float = 0.0  # adds this x the negative log-likelihood of the trained tokens of samples with reward >=
    # sft_min_reward (0: off)
    sft_min_reward: Optional[float] = None  # the SFT term and the sft loss train only samples whose episode reward is
    # at least this (rejection sampling); unset: every sample
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal (no GRPO signal) and draw more
    # groups until the step has rollout.prompts_per_step
    dynamic_sampling_max_groups: int = 0  # dynamic sampling: groups one step may draw in all, kept and dropped; past it
    # equal groups are kept (0: 4 x rollout.prompts_per_step)
    overlong_max_tokens: int = 0  # DAPO overlong reward shaping: an episode generating more tokens gets
    # -overlong_penalty added to its reward (0: off)
    overlong_buffer_tokens: int = 0  # the last this many tokens before overlong_max_tokens cost a linearly growing
    # share of overlong_penalty
    overlong_penalty: float = 1.0  # the largest overlong shaping penalty
    distill_teacher: Optional[str] = None  # on-policy distillation: the teacher, a model path the run serves with an
    # engine of its own, or the http:// URL of a running engine (SGLang or rayrl's CPU engine); same tokenizer as the
    # student
    distill_coef: float = 1.0  # on-policy distillation: each token's advantage minus this x (student log-prob - teacher
    # log-prob), the sampled reverse KL

    def __post_init__(self) -> None:
        non_negative(self, "algorithm.", "loss_agg_norm", "dual_clip_c", "entropy_coef", "kl_loss_coef",
                     "kl_reward_coef", "sft_coef", "dynamic_sampling_max_groups", "overlong_max_tokens",
                     "overlong_buffer_tokens", "overlong_penalty", "distill_coef")
        for name in ("clip_eps", "clip_eps_high", "tis_cap"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"algorithm.{name}: must be >= 0, got {value!r}")
        if 0 < self.dual_clip_c <= 1.0:
            raise ConfigError(f"algorithm.dual_clip_c: must be 0 (off) or > 1, got {self.dual_clip_c!r}")
        if self.overlong_buffer_tokens and self.overlong_buffer_tokens > self.overlong_max_tokens:
            raise ConfigError("algorithm.overlong_buffer_tokens: must not exceed algorithm.overlong_max_tokens")
        for name in ("advantage_estimator", "policy_loss"):
            if not getattr(self, name):
                raise ConfigError(f"algorithm.{name}: must name a registered one or package.module:function")
        if self.distill_teacher is not None and not self.distill_teacher:
            raise ConfigError("algorithm.distill_teacher: must not be empty (unset it to turn distillation off)")

    @property
    def uses_reference(self) -> bool:
        """Whether the trainer ranks hold a reference model (a KL to it is on)."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0
