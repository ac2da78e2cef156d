"""Policy losses: the per-token surrogate a trainer minimises, chosen by name.

``algorithm.policy_loss`` names one of :data:`POLICY_LOSSES` or a ``package.module:function`` of your
own. Each row is a :class:`PolicyLoss`: the function and the traits the rest of rayrl asks of it (its
default clip band, its ``loss_agg: auto``, whether it needs whole sequences on a rank, whether its band is
narrower than the engine-trainer gap, whether it is a likelihood target); nothing outside this table
compares a loss's name. A loss of your own declares its traits with :func:`loss_traits`. The contract
every loss keeps:

- **input** (:class:`PolicyLossInput`): one micro-batch's *trained* tokens, flattened to shape [T], in
  sample order (every tensor aligned): ``logp``, the current policy's log-probs (the only input that
  carries a gradient); ``old_logp``, the ratio's denominator (the rollout log-probs, or with TIS the
  trainer's own before the step's first update, rayrl/rl/objective.py); ``advantages``; and
  ``seq_index`` (int64), which of the micro-batch's ``num_seqs`` sequences each token belongs to. A
  sequence is whole within a micro-batch (never split over micro-batches or ranks), but its tokens
  need not be adjacent. ``clip_low`` / ``clip_high`` / ``dual_clip_c`` are the resolved clip settings.
- **output** (:class:`PolicyLossOutput`): ``per_token`` [T], the loss of each token *before* the
  truncated importance weight and the aggregation (the helper multiplies by both, so a loss never
  normalises itself; a ``supervised`` loss gets no importance weight), and ``clipped`` [T], 1.0
  where a clip took the token's gradient away or capped it (detached; reported as ``train/clip_fraction``).
- Masks are already applied: every token given is trained. Nothing may be reduced over tokens except
  within a sequence (GSPO's sequence ratio).

Formulas and papers: docs/algorithms.md. Hand-computed tests: tests/rl/test_policy_losses.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from rayrl.config import ConfigError
from rayrl.extensions import named_callable

if TYPE_CHECKING:  # torch is imported where a loss runs (the trainer), not where the table is read: the driver
    import torch  # reads it before Ray starts (rayrl/resolve.py, rayrl/rl/updates.py), and torch takes seconds

MAX_LOG_RATIO = 20.0  # exp() of a larger log-ratio overflows float32's useful range; clamped, as the peers do
MAX_SEQ_LOG_RATIO = 10.0  # GSPO: the sequence log-ratio is clamped here before exp()


@dataclass
class PolicyLossInput:
    """One micro-batch's trained tokens (module docstring)."""

    logp: torch.Tensor  # [T], carries the gradient
    old_logp: torch.Tensor  # [T]
    advantages: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T] int64 in [0, num_seqs)
    num_seqs: int
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float = 0.0  # 0: off


@dataclass
class PolicyLossOutput:
    per_token: torch.Tensor  # [T]
    clipped: torch.Tensor  # [T] 0/1, detached


PolicyLossFn = Callable[[PolicyLossInput], PolicyLossOutput]


def _clipped_surrogate(ratio: torch.Tensor, x: PolicyLossInput) -> PolicyLossOutput:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))``, with dual-clip's ``min(., c |A|)`` for A < 0."""
    import torch
    adv = x.advantages
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high)
    loss = torch.maximum(unclipped, clipped)
    if x.dual_clip_c > 0:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * x.dual_clip_c), loss)
    return PolicyLossOutput(loss, (loss.detach() != unclipped.detach()).to(x.logp.dtype))


def ppo_clip(x: PolicyLossInput) -> PolicyLossOutput:
    """PPO's clipped surrogate per token (Schulman et al. 2017) with asymmetric ranges (DAPO's
    clip-higher, Yu et al. 2025) and optional dual-clip (Ye et al. 2020): ``r = exp(logp - old)``."""
    import torch
    ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, x)


def gspo(x: PolicyLossInput) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its tokens'
    ratios, ``s = exp(mean_t(logp - old))``, clipped in a narrow band (3e-4 / 4e-4 by default). Written
    as GSPO-token: each token's ratio is ``sg(s) * exp(logp - sg(logp))``, whose value is ``s`` and whose
    gradient is ``s * grad(logp)``; with the ``seq_mean_token_mean`` aggregation this is exactly GSPO's
    sequence-level gradient."""
    import torch
    log_ratio = (x.logp - x.old_logp).detach()
    sums = torch.zeros(x.num_seqs, dtype=log_ratio.dtype, device=log_ratio.device)
    sums.index_add_(0, x.seq_index, log_ratio)
    counts = torch.zeros_like(sums).index_add_(0, x.seq_index, torch.ones_like(log_ratio))
    seq_log_ratio = (sums / counts.clamp(min=1.0))[x.seq_index]
    token_log_ratio = torch.clamp(x.logp - x.logp.detach() + seq_log_ratio, max=MAX_SEQ_LOG_RATIO)
    return _clipped_surrogate(torch.exp(token_log_ratio), x)


def cispo(x: PolicyLossInput) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): REINFORCE with the importance weight clipped and stop-gradient,
    ``-sg(clip(r, 1 - low, 1 + high)) * A * logp``; a clipped token keeps its gradient (only its weight
    is capped), unlike PPO. Default band: no lower bound (low 1.0), upper 4.0."""
    import torch
    ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    weight = torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high)
    return PolicyLossOutput(-weight * x.advantages * x.logp, (weight != ratio).to(x.logp.dtype))


def sft(x: PolicyLossInput) -> PolicyLossOutput:
    """Supervised fine-tuning on the trained tokens: the negative log-likelihood ``-logp``; advantages
    are ignored (which samples train is ``algorithm.sft_min_reward``'s choice: rejection sampling)."""
    import torch
    return PolicyLossOutput(-x.logp, torch.zeros_like(x.logp).detach())


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss and its traits (a row of :data:`POLICY_LOSSES`, or what a loss of your own declared).

    ``clip``: ``(clip_eps, clip_eps_high)`` when ``algorithm.clip_eps`` / ``clip_eps_high`` are unset (None:
    a loss of your own that declared no band; ``algorithm.clip_eps`` and ``clip_eps_high`` must then be set).
    ``aggregation``: what ``loss_agg: auto`` becomes with it (None: the estimator's, else token_mean).
    ``whole_sequence``: it reduces over a sequence's tokens, so a sequence must be whole on a rank
    (``trainer.cp_size`` 1). ``narrow_band``: its band is narrower than the engine-trainer log-prob gap,
    so its ratio must be taken against the trainer's own log-probs (``tis_cap`` on by default, whatever
    the schedule). ``supervised``: a likelihood target, not a policy-gradient estimate: advantages are
    ignored, the truncated importance weight does not multiply it (weighting would down-weight exactly
    the tokens the trainer now finds less likely than the engine did), and only the samples
    ``algorithm.sft_min_reward`` admits train. ``dual_clip``: ``algorithm.dual_clip_c`` applies to it.
    """

    name: str
    fn: PolicyLossFn
    clip: Optional[tuple[float, float]] = None
    aggregation: Optional[str] = None
    whole_sequence: bool = False
    narrow_band: bool = False
    supervised: bool = False
    dual_clip: bool = False


PPO_BAND = (0.2, 0.28)  # PPO with DAPO's clip-higher
POLICY_LOSSES: dict[str, PolicyLoss] = {loss.name: loss for loss in (
    PolicyLoss("ppo_clip", ppo_clip, clip=PPO_BAND, dual_clip=True),
    # GSPO's paper: sequence-level ratios sit much closer to 1. Against the engine's log-probs its band clipped
    # 60% of a step's sequences before any update (docs/results/algorithms.md)
    PolicyLoss("gspo", gspo, clip=(3e-4, 4e-4), aggregation="seq_mean_token_mean", whole_sequence=True,
               narrow_band=True),
    PolicyLoss("cispo", cispo, clip=(1.0, 4.0)),  # no lower bound, slime's wide upper bound
    PolicyLoss("sft", sft, clip=PPO_BAND, supervised=True),  # its band is passed on unread (no ratio)
)}
TRAITS_ATTR = "rayrl_policy_loss"  # where loss_traits puts a loss of your own's record


def loss_traits(*, clip: Optional[tuple[float, float]], aggregation: Optional[str] = None,
                whole_sequence: bool = False, narrow_band: bool = False, supervised: bool = False,
                dual_clip: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Declare a loss of your own's traits (:class:`PolicyLoss`), for ``algorithm.policy_loss:
    package.module:function``; ``clip`` is its default band, or None for none (the run then needs
    ``algorithm.clip_eps`` and ``clip_eps_high``)::

        @loss_traits(clip=(0.2, 0.28))
        def my_loss(x: PolicyLossInput) -> PolicyLossOutput: ...

    A function without it runs with no default band, ``loss_agg: auto`` by the estimator, and
    ``dual_clip_c`` passed on."""
    def declare(fn: PolicyLossFn) -> PolicyLossFn:
        setattr(fn, TRAITS_ATTR, PolicyLoss(fn.__name__, fn, clip, aggregation, whole_sequence, narrow_band,
                                            supervised, dual_clip))
        return fn

    return declare


def policy_loss(name: str) -> PolicyLoss:
    """The row ``name`` (a built-in), or the record of the function a ``package.module:function`` names (its
    declared traits, else none); ConfigError naming ``algorithm.policy_loss``."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    fn = named_callable("algorithm.policy_loss", name, POLICY_LOSSES)
    declared = getattr(fn, TRAITS_ATTR, None)
    if declared is None:
        return PolicyLoss(name, fn, dual_clip=True)
    if not isinstance(declared, PolicyLoss):
        raise ConfigError(f"algorithm.policy_loss: {name}.{TRAITS_ATTR} is not a PolicyLoss (use loss_traits)")
    return PolicyLoss(name, fn, declared.clip, declared.aggregation, declared.whole_sequence, declared.narrow_band,
                      declared.supervised, declared.dual_clip)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(current || reference) from the sampled token's log-probs (Schulman,
    "Approximating KL divergence", 2020): k1 ``logp - ref``; k2 ``(logp - ref)^2 / 2``; k3 (low variance,
    never negative) ``exp(ref - logp) - (ref - logp) - 1``, its log-ratio clamped to +-20 and its value
    to 10 as verl and slime do."""
    import torch
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_r = torch.clamp(-diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.clamp(torch.exp(log_r) - log_r - 1.0, max=10.0)
    raise ValueError(f"algorithm.kl_loss_type: unknown {kind!r} (k1, k2 or k3)")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's softmax distribution, ``logsumexp(z) - sum(softmax(z) * z)``, in float32."""
    import torch
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
