"""Advantage estimators: one number per episode from the step's rewards, chosen by name.

``algorithm.advantage_estimator`` names one of :data:`ESTIMATORS` or a ``package.module:function`` of
your own. Each row is an :class:`AdvantageEstimator`: the function and its traits (whether it measures an
episode against its group, what ``loss_agg: auto`` becomes with it); nothing outside this table compares
an estimator's name. An estimator of your own declares its traits with :func:`estimator_traits`. The
contract every estimator keeps:

- **input** (:class:`EstimatorInput`): the step's *successful* episodes, in batch order. ``rewards``
  (float64, shape [n]) are the episodes' rewards after reward shaping (rayrl/rl/shaping.py);
  ``group_ids`` ([n] strings) say which episodes ran the same task (a group); ``token_counts`` (int64,
  [n]) are the tokens each episode trains (its samples' ``loss_mask`` summed; 0 for an episode that
  trains nothing). Failed episodes are not in the input: a group may hold fewer than
  ``rollout.group_size`` episodes, at least ``rollout.min_group_episodes`` unless its reruns ran out,
  possibly just one. Groups need not be contiguous.
  ``options`` (:class:`EstimatorOptions`) carries the conventions a user can choose (``algorithm.grpo_std``,
  ``algorithm.singleton_groups``).
- **output**: float32 array of shape [n], the advantage of each episode; every trained token of every
  sample of the episode gets it. The trainer skips samples whose advantage is 0 unless another term
  of the loss (KL, entropy, SFT) trains them, so zero must be *exactly* zero.
- **exact zeros**: a reward difference within :data:`REWARD_TOLERANCE` (the tolerance DAPO's dynamic
  sampling uses to call a group's rewards equal, rayrl/rl/groups.py ``equal_reward``) is no difference.
  Every built-in estimator takes its baseline difference ``r - b`` through :func:`centred`, which makes
  one within the tolerance exactly 0.0: a group of equal rewards such as (0.1, 0.1, 0.1), whose float
  mean is not exactly 0.1, gets zeros, not 1e-11 (GRPO) or 1e-17 (RLOO), so its samples neither count as
  trained nor enter the token-mean normaliser nor cause a weight push. The batch-whitened estimators keep
  those zeros after whitening (docs/algorithms.md, "Conventions").
- **pure**: no state, no randomness; the same input gives the same output on every call.

Per-token terms come later and are the same for every estimator: on-policy distillation's reverse KL
(rayrl/rl/distill.py, driver side) and the KL penalty in the reward (rayrl/rl/objective.py, on the
trainer ranks, where the reference log-probs are). GAE needs a value model per token, which no backend
holds yet; the resolve step refuses it (:data:`NOT_AVAILABLE`).

Formulas and papers: docs/algorithms.md. Hand-computed tests: tests/rl/test_advantages.py.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from rayrl.config import ConfigError
from rayrl.extensions import named_callable

EPS = 1e-6  # keeps a division by a (near-)zero standard deviation finite: added to the std, outside the sqrt
REWARD_TOLERANCE = 1e-9  # rewards closer than this are equal (dynamic sampling's test too: rayrl/rl/groups.py)
GRPO_STD = ("population", "sample")  # algorithm.grpo_std: divide by sqrt(sum/G) or by sqrt(sum/(G-1))
SINGLETON_GROUPS = ("zero", "reward")  # algorithm.singleton_groups: a group of one gets 0, or its raw reward


@dataclass(frozen=True)
class EstimatorOptions:
    """The conventions where peers differ and users may want either (docs/algorithms.md, "Conventions")."""

    grpo_std: str = "population"  # GRPO's std: population (DeepSeekMath's formula), or sample (verl, TRL, slime)
    singleton_groups: str = "zero"  # a group left with one episode: no baseline, advantage 0; or "reward" (verl)

    def __post_init__(self) -> None:
        if self.grpo_std not in GRPO_STD:
            raise ValueError(f"grpo_std: {self.grpo_std!r} is not one of {GRPO_STD}")
        if self.singleton_groups not in SINGLETON_GROUPS:
            raise ValueError(f"singleton_groups: {self.singleton_groups!r} is not one of {SINGLETON_GROUPS}")


@dataclass(frozen=True)
class EstimatorInput:
    """What an estimator sees (module docstring): one entry per successful episode, batch order."""

    rewards: np.ndarray  # float64 [n]
    group_ids: tuple[str, ...]  # [n]
    token_counts: np.ndarray  # int64 [n]
    options: EstimatorOptions = EstimatorOptions()

    @classmethod
    def of(cls, rewards: Sequence[float], group_ids: Sequence[str],
           token_counts: Sequence[int] | None = None, options: EstimatorOptions | None = None) -> EstimatorInput:
        n = len(rewards)
        if len(group_ids) != n or (token_counts is not None and len(token_counts) != n):
            raise ValueError("rewards, group_ids and token_counts must have one entry per episode")
        counts = np.ones(n, np.int64) if token_counts is None else np.asarray(token_counts, np.int64)
        return cls(np.asarray(rewards, np.float64), tuple(group_ids), counts, options or EstimatorOptions())

    def groups(self) -> list[np.ndarray]:
        """Indices of each group's episodes, groups in order of first appearance."""
        by_id: dict[str, list[int]] = defaultdict(list)
        for i, gid in enumerate(self.group_ids):
            by_id[gid].append(i)
        return [np.asarray(idx) for idx in by_id.values()]


EstimatorFn = Callable[[EstimatorInput], np.ndarray]


def centred(values: np.ndarray, baseline: np.ndarray | float) -> np.ndarray:
    """``values - baseline``, exactly 0.0 wherever the two are within :data:`REWARD_TOLERANCE`."""
    diff = np.asarray(values, np.float64) - baseline
    return np.where(np.abs(diff) <= REWARD_TOLERANCE, 0.0, diff)


def _singleton(x: EstimatorInput, idx: np.ndarray) -> np.ndarray:
    """A group of one has no baseline: 0 (no signal), or its raw reward with ``singleton_groups: reward``."""
    return x.rewards[idx] if x.options.singleton_groups == "reward" else np.zeros(len(idx))


def _group_centred(x: EstimatorInput) -> np.ndarray:
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        r = x.rewards[idx]
        out[idx] = _singleton(x, idx) if len(idx) == 1 else centred(r, r.mean())
    return out


def _whiten(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(v - mean) / (std + EPS) over the batch, each episode weighted by its trained tokens (the token
    statistics of REINFORCE++'s batch normalisation); equal weights when no episode trains a token. A
    value that is exactly 0 (no signal: module docstring) stays 0; the statistics include it."""
    w = weights.astype(np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    mean = float((w * values).sum() / w.sum())
    shifted = values - mean
    std = float(np.sqrt((w * shifted ** 2).sum() / w.sum()))
    if std <= REWARD_TOLERANCE:
        return np.zeros_like(values)
    return np.where(values == 0.0, 0.0, shifted / (std + EPS))


def grpo(x: EstimatorInput) -> np.ndarray:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r - mean(group)) / (std(group) + EPS)``, std the
    population standard deviation of the group's rewards, or the sample one with ``grpo_std: sample``."""
    ddof = 1 if x.options.grpo_std == "sample" else 0
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        r = x.rewards[idx]
        if len(idx) == 1:
            out[idx] = _singleton(x, idx) / (1.0 + EPS)
            continue
        diff = centred(r, r.mean())
        out[idx] = 0.0 if not diff.any() else diff / (r.std(ddof=ddof) + EPS)
    return out.astype(np.float32)


def dr_grpo(x: EstimatorInput) -> np.ndarray:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r - mean(group)``, no std
    division (which weights easy and hard tasks unequally). Its other half, the constant normaliser, is
    the aggregation ``seq_mean_token_sum_norm`` that ``loss_agg: auto`` picks with it."""
    return _group_centred(x).astype(np.float32)


def rloo(x: EstimatorInput) -> np.ndarray:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``r_i - mean(r_j, j != i)`` over the group, which
    is ``k / (k - 1) * (r_i - mean(group))`` for a group of k; a group of one: ``singleton_groups``."""
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        k = len(idx)
        r = x.rewards[idx]
        out[idx] = _singleton(x, idx) if k == 1 else centred(r, (r.sum() - r) / (k - 1))
    return out.astype(np.float32)


def reinforce_pp(x: EstimatorInput) -> np.ndarray:
    """REINFORCE++ (Hu 2025): the reward (an outcome reward is each token's return with gamma 1),
    normalised over the whole batch: ``(r - mean) / (std + EPS)``, token-weighted. No group baseline; a
    batch whose rewards are all equal gets zeros."""
    w = x.token_counts.astype(np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    diff = centred(x.rewards, float((w * x.rewards).sum() / w.sum()))
    if not diff.any():
        return np.zeros(len(diff), np.float32)
    std = float(np.sqrt((w * diff ** 2).sum() / w.sum()))
    return (diff / (std + EPS)).astype(np.float32)


def reinforce_pp_baseline(x: EstimatorInput) -> np.ndarray:
    """REINFORCE++-baseline (Hu 2025): ``r - mean(group)``, then normalised over the whole batch
    (token-weighted mean and std, re-centred), so the scale comes from the batch, not from each group's
    spread. An episode at its group's mean (every episode of an equal group) keeps 0."""
    return _whiten(_group_centred(x), x.token_counts).astype(np.float32)


@dataclass(frozen=True)
class AdvantageEstimator:
    """One estimator and its traits (a row of :data:`ESTIMATORS`, or what an estimator of your own declared).

    ``grouped``: it measures each episode against its group, so ``rollout.group_size`` must be at least 2.
    ``aggregation``: what ``loss_agg: auto`` becomes with it unless the loss has its own (None: token_mean).
    """

    name: str
    fn: EstimatorFn
    grouped: bool = False
    aggregation: Optional[str] = None


ESTIMATORS: dict[str, AdvantageEstimator] = {estimator.name: estimator for estimator in (
    AdvantageEstimator("grpo", grpo, grouped=True),
    AdvantageEstimator("dr_grpo", dr_grpo, grouped=True, aggregation="seq_mean_token_sum_norm"),  # its constant norm
    AdvantageEstimator("rloo", rloo, grouped=True),
    AdvantageEstimator("reinforce_pp", reinforce_pp),
    AdvantageEstimator("reinforce_pp_baseline", reinforce_pp_baseline, grouped=True),
)}
NOT_AVAILABLE = {"gae": "needs a critic (a value model), which neither trainer backend holds yet"}
TRAITS_ATTR = "rayrl_advantage_estimator"  # where estimator_traits puts an estimator of your own's record


def estimator_traits(*, grouped: bool = False,
                     aggregation: Optional[str] = None) -> Callable[[EstimatorFn], EstimatorFn]:
    """Declare an estimator of your own's traits (:class:`AdvantageEstimator`), for
    ``algorithm.advantage_estimator: package.module:function``::

        @estimator_traits(grouped=True)
        def my_estimator(x: EstimatorInput) -> np.ndarray: ...

    A function without it is taken as ungrouped, with ``loss_agg: auto`` left to the loss."""
    def declare(fn: EstimatorFn) -> EstimatorFn:
        setattr(fn, TRAITS_ATTR, AdvantageEstimator(fn.__name__, fn, grouped, aggregation))
        return fn

    return declare


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The row ``name`` (a built-in), or the record of the function a ``package.module:function`` names (its
    declared traits, else none); ConfigError naming ``algorithm.advantage_estimator``."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if name in NOT_AVAILABLE:
        raise ConfigError(f"algorithm.advantage_estimator: {name} {NOT_AVAILABLE[name]}; use one of "
                          f"{', '.join(ESTIMATORS)}")
    fn = named_callable("algorithm.advantage_estimator", name, ESTIMATORS)
    declared = getattr(fn, TRAITS_ATTR, None)
    if declared is None:
        return AdvantageEstimator(name, fn)
    if not isinstance(declared, AdvantageEstimator):
        raise ConfigError(f"algorithm.advantage_estimator: {name}.{TRAITS_ATTR} is not an AdvantageEstimator "
                          "(use estimator_traits)")
    return AdvantageEstimator(name, fn, declared.grouped, declared.aggregation)


def estimate(name: str, x: EstimatorInput) -> np.ndarray:
    """Run estimator ``name`` on ``x`` and check what it returned (shape [n], finite)."""
    out = np.asarray(advantage_estimator(name).fn(x), dtype=np.float32)
    if out.shape != x.rewards.shape:
        raise ValueError(f"advantage estimator {name!r} returned shape {out.shape} for {len(x.rewards)} episodes")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"advantage estimator {name!r} returned a non-finite advantage")
    return out
